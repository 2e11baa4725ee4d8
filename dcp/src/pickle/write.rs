//! A pickler for [`Value`] trees, emitting what CPython's pickler emits for the same objects.
//!
//! Protocol 2 is what torch.save uses for `data.pkl` (`GLOBAL`, `BINPUT` after every
//! memoizable object); protocol 4 is what `pickle.dump` (DCP's `.metadata`) uses (`FRAME`,
//! `STACK_GLOBAL`, `MEMOIZE`, short opcodes). Globals and equal strings are written once and
//! referenced with `BINGET` afterwards, as CPython does for the same (interned) objects, so a
//! tensor's `data.pkl` comes out byte-identical to torch's.

use std::collections::HashMap;

use super::globals::Global;
use super::value::{Construct, Object, Value};

/// Which pickle protocol to emit (2, 3 or 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocol(u8);

impl Protocol {
    /// torch.save's `data.pkl`.
    pub const TORCH_SAVE: Protocol = Protocol(2);
    /// `pickle.dump` on CPython 3.8-3.13 (DCP `.metadata`).
    pub const DEFAULT: Protocol = Protocol(4);

    /// `None` unless `v` is 2, 3 or 4.
    pub fn new(v: u8) -> Option<Protocol> {
        (2..=4).contains(&v).then_some(Protocol(v))
    }
}

/// Pickles `value` with `protocol`.
pub fn pickle(value: &Value, protocol: Protocol) -> Vec<u8> {
    let mut p = Pickler {
        out: Vec::new(),
        proto: protocol.0,
        memo_len: 0,
        strings: HashMap::new(),
        globals: HashMap::new(),
        frame_cuts: Vec::new(),
    };
    p.save(value);
    p.out.push(b'.');
    if protocol.0 >= 4 {
        p.framed()
    } else {
        let mut out = vec![0x80, protocol.0];
        out.extend_from_slice(&p.out);
        out
    }
}

const FRAME_TARGET: usize = 64 * 1024;

struct Pickler {
    out: Vec<u8>,
    proto: u8,
    memo_len: u32,
    strings: HashMap<String, u32>,
    globals: HashMap<Global, u32>,
    /// Positions in `out` where a frame may end (CPython commits frames at `save()` entry).
    frame_cuts: Vec<usize>,
}

impl Pickler {
    /// Splits the body into FRAMEs of about 64 KiB at object boundaries, as CPython's framer.
    fn framed(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.out.len() + 16);
        out.extend_from_slice(&[0x80, self.proto]);
        let mut start = 0;
        let emit = |from: usize, to: usize, out: &mut Vec<u8>| {
            // CPython writes no FRAME header for frames under 4 bytes.
            if to - from >= 4 {
                out.push(0x95);
                out.extend_from_slice(&((to - from) as u64).to_le_bytes());
                out.extend_from_slice(&self.out[from..to]);
            } else {
                out.extend_from_slice(&self.out[from..to]);
            }
        };
        for &cut in &self.frame_cuts {
            if cut - start >= FRAME_TARGET {
                emit(start, cut, &mut out);
                start = cut;
            }
        }
        emit(start, self.out.len(), &mut out);
        out
    }

    fn memoize(&mut self) -> u32 {
        let idx = self.memo_len;
        if self.proto >= 4 {
            self.out.push(0x94);
        } else if idx < 256 {
            self.out.extend_from_slice(&[b'q', idx as u8]);
        } else {
            self.out.push(b'r');
            self.out.extend_from_slice(&idx.to_le_bytes());
        }
        self.memo_len += 1;
        idx
    }

    fn get(&mut self, idx: u32) {
        if idx < 256 {
            self.out.extend_from_slice(&[b'h', idx as u8]);
        } else {
            self.out.push(b'j');
            self.out.extend_from_slice(&idx.to_le_bytes());
        }
    }

    fn save(&mut self, v: &Value) {
        if self.proto >= 4 {
            self.frame_cuts.push(self.out.len());
        }
        match v {
            Value::None => self.out.push(b'N'),
            Value::Bool(true) => self.out.push(0x88),
            Value::Bool(false) => self.out.push(0x89),
            Value::Int(i) => self.save_int(*i),
            Value::BigInt(b) => {
                if b.len() < 256 {
                    self.out.extend_from_slice(&[0x8a, b.len() as u8]);
                } else {
                    self.out.push(0x8b);
                    self.out.extend_from_slice(&(b.len() as u32).to_le_bytes());
                }
                self.out.extend_from_slice(b);
            }
            Value::Float(f) => {
                self.out.push(b'G');
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::Str(s) => self.save_str(s),
            Value::Bytes(b) => self.save_bytes(b),
            Value::Tuple(items) => self.save_tuple(items),
            Value::List(items) => {
                self.out.push(b']');
                self.memoize();
                self.batch_appends(items);
            }
            Value::Dict(items) => {
                self.out.push(b'}');
                self.memoize();
                self.batch_setitems(items);
            }
            Value::Set(items) => {
                if self.proto >= 4 {
                    self.out.push(0x8f);
                    self.memoize();
                    for batch in items.chunks(1000) {
                        self.out.push(b'(');
                        for item in batch {
                            self.save(item);
                        }
                        self.out.push(0x90);
                    }
                } else {
                    self.save_global(Global::BUILTIN_SET);
                    self.save_tuple(&[Value::List(items.clone())]);
                    self.out.push(b'R');
                    self.memoize();
                }
            }
            Value::Global(g) if g.is_layout() => {
                // torch pickles layouts as `_get_layout("torch.strided")`.
                self.save_global(Global::GET_LAYOUT);
                self.save_tuple(&[Value::Str(format!("torch.{}", g.name))]);
                self.out.push(b'R');
                self.memoize();
            }
            Value::Global(g) => self.save_global(*g),
            Value::Object(o) => self.save_object(o),
            Value::PersistentId(pid) => {
                self.save(pid);
                self.out.push(b'Q');
            }
        }
    }

    fn save_int(&mut self, i: i64) {
        if (0..=0xff).contains(&i) {
            self.out.extend_from_slice(&[b'K', i as u8]);
        } else if (0..=0xffff).contains(&i) {
            self.out.push(b'M');
            self.out.extend_from_slice(&(i as u16).to_le_bytes());
        } else if i32::try_from(i).is_ok() {
            self.out.push(b'J');
            self.out.extend_from_slice(&(i as i32).to_le_bytes());
        } else {
            // LONG1 with the shortest two's complement encoding, as `pickle.encode_long`.
            let bytes = i.to_le_bytes();
            let mut n = 8;
            while n > 1 {
                let top = bytes[n - 1];
                let next_sign = bytes[n - 2] & 0x80;
                if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.out.extend_from_slice(&[0x8a, n as u8]);
            self.out.extend_from_slice(&bytes[..n]);
        }
    }

    fn save_str(&mut self, s: &str) {
        if let Some(&idx) = self.strings.get(s) {
            self.get(idx);
            return;
        }
        let b = s.as_bytes();
        if self.proto >= 4 && b.len() < 256 {
            self.out.extend_from_slice(&[0x8c, b.len() as u8]);
        } else if self.proto >= 4 && b.len() > u32::MAX as usize {
            self.out.push(0x8d);
            self.out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        } else {
            self.out.push(b'X');
            self.out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        }
        self.out.extend_from_slice(b);
        let idx = self.memoize();
        self.strings.insert(s.to_string(), idx);
    }

    fn save_bytes(&mut self, b: &[u8]) {
        if self.proto < 3 {
            // Protocol 2 has no bytes opcode: CPython writes `_codecs.encode(latin1_str, "latin1")`.
            let latin1: String = b.iter().map(|&c| c as char).collect();
            self.save_global(Global::CODECS_ENCODE);
            self.save_tuple(&[Value::Str(latin1), Value::str("latin1")]);
            self.out.push(b'R');
            self.memoize();
            return;
        }
        if b.len() < 256 {
            self.out.extend_from_slice(&[b'C', b.len() as u8]);
        } else if self.proto >= 4 && b.len() > u32::MAX as usize {
            self.out.push(0x8e);
            self.out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        } else {
            self.out.push(b'B');
            self.out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        }
        self.out.extend_from_slice(b);
        self.memoize();
    }

    fn save_tuple(&mut self, items: &[Value]) {
        match items.len() {
            0 => {
                self.out.push(b')');
                return;
            }
            1..=3 => {
                for item in items {
                    self.save(item);
                }
                self.out.push(0x84 + items.len() as u8);
            }
            _ => {
                self.out.push(b'(');
                for item in items {
                    self.save(item);
                }
                self.out.push(b't');
            }
        }
        self.memoize();
    }

    fn batch_appends(&mut self, items: &[Value]) {
        if items.len() == 1 {
            self.save(&items[0]);
            self.out.push(b'a');
            return;
        }
        for batch in items.chunks(1000) {
            if batch.len() == 1 {
                self.save(&batch[0]);
                self.out.push(b'a');
            } else {
                self.out.push(b'(');
                for item in batch {
                    self.save(item);
                }
                self.out.push(b'e');
            }
        }
    }

    fn batch_setitems(&mut self, items: &[(Value, Value)]) {
        for batch in items.chunks(1000) {
            if batch.len() == 1 {
                self.save(&batch[0].0);
                self.save(&batch[0].1);
                self.out.push(b's');
            } else {
                self.out.push(b'(');
                for (k, v) in batch {
                    self.save(k);
                    self.save(v);
                }
                self.out.push(b'u');
            }
        }
    }

    fn save_global(&mut self, g: Global) {
        if let Some(&idx) = self.globals.get(&g) {
            self.get(idx);
            return;
        }
        if self.proto >= 4 {
            self.save_str(g.module);
            self.save_str(g.name);
            self.out.push(0x93);
        } else {
            self.out.push(b'c');
            self.out.extend_from_slice(g.module.as_bytes());
            self.out.push(b'\n');
            self.out.extend_from_slice(g.name.as_bytes());
            self.out.push(b'\n');
        }
        let idx = self.memoize();
        self.globals.insert(g, idx);
    }

    fn save_object(&mut self, o: &Object) {
        self.save_global(o.class);
        self.save_tuple(&o.args);
        self.out.push(match o.construct {
            Construct::Reduce => b'R',
            Construct::NewObj => 0x81,
        });
        self.memoize();
        if !o.list_items.is_empty() {
            self.batch_appends(&o.list_items);
        }
        if !o.dict_items.is_empty() {
            self.batch_setitems(&o.dict_items);
        }
        if let Some(state) = &o.state {
            self.save(state);
            self.out.push(b'b');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::read::unpickle;
    use super::*;

    fn sample() -> Value {
        Value::Object(Box::new(Object::new_with_state(
            Global::STORAGE_INFO,
            Value::Dict(vec![
                (Value::str("relative_path"), Value::str("__0_0.distcp")),
                (Value::str("offset"), Value::Int(5_000_000_000)),
                (Value::str("length"), Value::Int(-70000)),
                (
                    Value::str("transform_descriptors"),
                    Value::List(vec![Value::str("stream.zstd/1")]),
                ),
                (Value::str("f"), Value::Float(0.5)),
                (Value::str("b"), Value::Bytes(vec![0, 255, 7])),
                (Value::str("layout"), Value::Global(Global::TORCH_STRIDED)),
                (
                    Value::str("t"),
                    Value::Tuple(vec![Value::None, Value::Bool(true), Value::Int(300)]),
                ),
                (Value::str("long"), Value::Str("x".repeat(300))),
                (Value::str("set"), Value::Set(vec![Value::Int(1)])),
            ]),
        )))
    }

    #[test]
    fn round_trips_at_protocols_2_3_4() {
        let v = sample();
        for p in 2..=4 {
            let bytes = pickle(&v, Protocol::new(p).unwrap());
            assert_eq!(unpickle(&bytes).unwrap(), v, "protocol {p}");
        }
    }

    #[test]
    fn large_pickles_are_split_into_frames() {
        let v = Value::List((0..20_000).map(|i| Value::Str(format!("s{i}"))).collect());
        let bytes = pickle(&v, Protocol::DEFAULT);
        assert_eq!(bytes[2], 0x95);
        let first = u64::from_le_bytes(bytes[3..11].try_into().unwrap()) as usize;
        assert!(first >= FRAME_TARGET && first < bytes.len() - 11);
        assert_eq!(unpickle(&bytes).unwrap(), v);
    }
}
