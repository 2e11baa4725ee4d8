//! An allow-list unpickler for protocols 2-5 over untrusted bytes.
//!
//! Nothing is imported or called: `GLOBAL`/`STACK_GLOBAL` resolve only names on the allow-list
//! ([`Global::lookup`]), and `REDUCE`/`NEWOBJ`/`BUILD` describe objects instead of building
//! them. Objects live in an arena while the stream runs so that mutations after memoization
//! (`BUILD`, `APPENDS`, `SETITEMS` on a memoized object) are seen by every reference, as in
//! Python; the arena becomes a [`Value`] tree at `STOP`. Every length is checked against the
//! remaining input before anything is allocated, and memo size, stack size, nesting depth and
//! the number of values produced are capped ([`Limits`]), so hostile input yields an error, never
//! a panic, a hang or a huge allocation.

use std::collections::HashMap;

use super::globals::Global;
use super::value::{Construct, Object, Value};

/// Caps on what an unpickled stream may use. The defaults fit DCP metadata of very large models.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest pickle accepted, in bytes.
    pub max_input_bytes: usize,
    /// Most memo entries.
    pub max_memo: usize,
    /// Deepest operand stack plus mark stack.
    pub max_stack: usize,
    /// Deepest nesting of containers in the result (also catches reference cycles).
    pub max_depth: usize,
    /// Most values in the resulting tree (shared references count once per use).
    pub max_values: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_input_bytes: 1 << 30,
            max_memo: 1 << 24,
            max_stack: 1 << 24,
            max_depth: 256,
            max_values: 1 << 26,
        }
    }
}

/// Why a pickle was refused.
#[derive(Debug, thiserror::Error)]
pub enum PickleError {
    #[error("pickle ends early at byte {at} (truncated or corrupt file)")]
    Truncated { at: usize },
    #[error(
        "disallowed global `{module}.{name}` at byte {at}: only DCP metadata classes and torch \
         tensor types may appear (nothing is executed; the file is malicious or written by an \
         unsupported tool)"
    )]
    DisallowedGlobal {
        module: String,
        name: String,
        at: usize,
    },
    #[error("unknown pickle opcode 0x{op:02x} at byte {at} (corrupt file)")]
    UnknownOpcode { op: u8, at: usize },
    #[error("unsupported pickle opcode {name} at byte {at}: {why}")]
    Unsupported {
        name: &'static str,
        at: usize,
        why: &'static str,
    },
    #[error("malformed pickle at byte {at}: {msg}")]
    Malformed { at: usize, msg: String },
    #[error("pickle exceeds the limit of {limit} {what} (corrupt or hostile file)")]
    Limit { what: &'static str, limit: usize },
}

type Id = usize;

/// A value under construction; containers point at other nodes of the arena.
enum Node {
    None,
    Bool(bool),
    Int(i64),
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
    Global(Global),
    Object(ObjNode),
    PersistentId(Id),
}

struct ObjNode {
    class: Global,
    construct: Construct,
    args: Vec<Id>,
    state: Option<Id>,
    list_items: Vec<Id>,
    dict_items: Vec<(Id, Id)>,
}

/// Unpickles `data` with the default [`Limits`].
pub fn unpickle(data: &[u8]) -> Result<Value, PickleError> {
    unpickle_with_limits(data, &Limits::default())
}

/// Unpickles `data`, refusing anything not on the allow-list or beyond `limits`.
pub fn unpickle_with_limits(data: &[u8], limits: &Limits) -> Result<Value, PickleError> {
    if data.len() > limits.max_input_bytes {
        return Err(PickleError::Limit {
            what: "input bytes",
            limit: limits.max_input_bytes,
        });
    }
    let mut m = Machine {
        data,
        pos: 0,
        op_at: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        limits,
    };
    let root = m.run()?;
    // Each byte of input can reference at most a handful of values; sharing (BINGET of a large
    // container many times) must not turn a small pickle into a huge tree.
    let mut budget = limits
        .max_values
        .min(data.len().saturating_mul(16).saturating_add(1024));
    let cap = budget;
    m.to_value(root, 0, &mut budget, cap)
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    op_at: usize,
    nodes: Vec<Node>,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: HashMap<u64, Id>,
    limits: &'a Limits,
}

mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const FLOAT: u8 = b'F';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const LONG: u8 = b'L';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const PERSID: u8 = b'P';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const STRING: u8 = b'S';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const UNICODE: u8 = b'V';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const INST: u8 = b'i';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const OBJ: u8 = b'o';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const EXT1: u8 = 0x82;
    pub const EXT2: u8 = 0x83;
    pub const EXT4: u8 = 0x84;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const NEWOBJ_EX: u8 = 0x92;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    pub const BYTEARRAY8: u8 = 0x96;
    pub const NEXT_BUFFER: u8 = 0x97;
    pub const READONLY_BUFFER: u8 = 0x98;
}

impl<'a> Machine<'a> {
    fn malformed(&self, msg: impl Into<String>) -> PickleError {
        PickleError::Malformed {
            at: self.op_at,
            msg: msg.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.data.len())
            .ok_or(PickleError::Truncated { at: self.op_at })?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn take_len(&mut self, n: u64) -> Result<&'a [u8], PickleError> {
        let n = usize::try_from(n).map_err(|_| PickleError::Truncated { at: self.op_at })?;
        self.take(n)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, PickleError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }

    fn u32(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }

    fn u64(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    /// A text line (protocol 0 arguments), without the newline.
    fn line(&mut self) -> Result<&'a str, PickleError> {
        const MAX_LINE: usize = 4096;
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .take(MAX_LINE)
            .position(|b| *b == b'\n')
            .ok_or_else(|| {
                if rest.len() < MAX_LINE {
                    PickleError::Truncated { at: self.op_at }
                } else {
                    self.malformed("text argument longer than 4096 bytes")
                }
            })?;
        let line = &rest[..n];
        self.pos += n + 1;
        std::str::from_utf8(line).map_err(|_| self.malformed("text argument is not UTF-8"))
    }

    fn utf8(&self, bytes: &[u8]) -> Result<String, PickleError> {
        String::from_utf8(bytes.to_vec()).map_err(|_| self.malformed("string is not valid UTF-8"))
    }

    fn add(&mut self, node: Node) -> Id {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    fn push(&mut self, id: Id) -> Result<(), PickleError> {
        if self.stack.len() + self.marks.len() >= self.limits.max_stack {
            return Err(PickleError::Limit {
                what: "stack entries",
                limit: self.limits.max_stack,
            });
        }
        self.stack.push(id);
        Ok(())
    }

    fn push_node(&mut self, node: Node) -> Result<(), PickleError> {
        let id = self.add(node);
        self.push(id)
    }

    fn pop(&mut self) -> Result<Id, PickleError> {
        // A MARK above the top means the stack is "empty" for this opcode.
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.malformed("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn top(&self) -> Result<Id, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.malformed("stack underflow"));
        }
        Ok(*self.stack.last().expect("checked above"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Id>, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| self.malformed("no MARK on the stack"))?;
        Ok(self.stack.split_off(mark))
    }

    fn memo_put(&mut self, key: u64) -> Result<(), PickleError> {
        let id = self.top()?;
        if self.memo.len() >= self.limits.max_memo && !self.memo.contains_key(&key) {
            return Err(PickleError::Limit {
                what: "memo entries",
                limit: self.limits.max_memo,
            });
        }
        self.memo.insert(key, id);
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), PickleError> {
        let id = *self
            .memo
            .get(&key)
            .ok_or_else(|| self.malformed(format!("memo entry {key} is not defined")))?;
        self.push(id)
    }

    fn global(&self, module: &str, name: &str) -> Result<Global, PickleError> {
        Global::lookup(module, name).ok_or_else(|| PickleError::DisallowedGlobal {
            module: module.to_string(),
            name: name.to_string(),
            at: self.op_at,
        })
    }

    fn str_of(&self, id: Id) -> Option<&str> {
        match &self.nodes[id] {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }

    fn int_from_le(bytes: &[u8]) -> Node {
        if bytes.is_empty() {
            return Node::Int(0);
        }
        if bytes.len() <= 8 {
            let negative = bytes[bytes.len() - 1] & 0x80 != 0;
            let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
            buf[..bytes.len()].copy_from_slice(bytes);
            return Node::Int(i64::from_le_bytes(buf));
        }
        Node::BigInt(bytes.to_vec())
    }

    fn run(&mut self) -> Result<Id, PickleError> {
        loop {
            self.op_at = self.pos;
            let code = self.u8()?;
            match code {
                op::PROTO => {
                    let v = self.u8()?;
                    if v > 5 {
                        return Err(self.malformed(format!("unsupported pickle protocol {v}")));
                    }
                }
                op::FRAME => {
                    let n = self.u64()?;
                    if n > (self.data.len() - self.pos) as u64 {
                        return Err(PickleError::Truncated { at: self.op_at });
                    }
                }
                op::STOP => {
                    let id = self.pop()?;
                    return Ok(id);
                }
                op::MARK => {
                    if self.stack.len() + self.marks.len() >= self.limits.max_stack {
                        return Err(PickleError::Limit {
                            what: "stack entries",
                            limit: self.limits.max_stack,
                        });
                    }
                    self.marks.push(self.stack.len());
                }
                op::POP => {
                    if self.stack.len() == self.marks.last().copied().unwrap_or(0)
                        && !self.marks.is_empty()
                    {
                        // POP with a MARK on top discards the mark (as CPython does).
                        self.marks.pop();
                    } else {
                        self.pop()?;
                    }
                }
                op::POP_MARK => {
                    self.pop_mark()?;
                }
                op::DUP => {
                    let id = self.top()?;
                    self.push(id)?;
                }
                op::NONE => self.push_node(Node::None)?,
                op::NEWTRUE => self.push_node(Node::Bool(true))?,
                op::NEWFALSE => self.push_node(Node::Bool(false))?,
                op::BININT => {
                    let v = self.u32()? as i32;
                    self.push_node(Node::Int(v as i64))?
                }
                op::BININT1 => {
                    let v = self.u8()?;
                    self.push_node(Node::Int(v as i64))?
                }
                op::BININT2 => {
                    let v = self.u16()?;
                    self.push_node(Node::Int(v as i64))?
                }
                op::LONG1 => {
                    let n = self.u8()? as usize;
                    let b = self.take(n)?;
                    self.push_node(Self::int_from_le(b))?
                }
                op::LONG4 => {
                    let n = self.u32()? as i32;
                    if n < 0 {
                        return Err(self.malformed("negative LONG4 length"));
                    }
                    let b = self.take(n as usize)?;
                    self.push_node(Self::int_from_le(b))?
                }
                op::INT => {
                    let line = self.line()?;
                    let node = match line {
                        "00" => Node::Bool(false),
                        "01" => Node::Bool(true),
                        s => Node::Int(
                            s.parse()
                                .map_err(|_| self.malformed(format!("bad INT `{s}`")))?,
                        ),
                    };
                    self.push_node(node)?
                }
                op::LONG => {
                    let line = self.line()?;
                    let s = line.strip_suffix('L').unwrap_or(line);
                    let v: i64 = s
                        .parse()
                        .map_err(|_| self.malformed(format!("bad or huge LONG `{s}`")))?;
                    self.push_node(Node::Int(v))?
                }
                op::FLOAT => {
                    let line = self.line()?;
                    let v: f64 = line
                        .parse()
                        .map_err(|_| self.malformed(format!("bad FLOAT `{line}`")))?;
                    self.push_node(Node::Float(v))?
                }
                op::BINFLOAT => {
                    let v = f64::from_be_bytes(self.take(8)?.try_into().unwrap());
                    self.push_node(Node::Float(v))?
                }
                op::BINUNICODE => {
                    let n = self.u32()?;
                    let b = self.take_len(n as u64)?;
                    let s = self.utf8(b)?;
                    self.push_node(Node::Str(s))?
                }
                op::SHORT_BINUNICODE => {
                    let n = self.u8()?;
                    let b = self.take(n as usize)?;
                    let s = self.utf8(b)?;
                    self.push_node(Node::Str(s))?
                }
                op::BINUNICODE8 => {
                    let n = self.u64()?;
                    let b = self.take_len(n)?;
                    let s = self.utf8(b)?;
                    self.push_node(Node::Str(s))?
                }
                // Python 2 `str`: decoded as latin-1, as torch.load does with encoding="latin1".
                op::BINSTRING => {
                    let n = self.u32()? as i32;
                    if n < 0 {
                        return Err(self.malformed("negative BINSTRING length"));
                    }
                    let b = self.take(n as usize)?;
                    self.push_node(Node::Str(b.iter().map(|&c| c as char).collect()))?
                }
                op::SHORT_BINSTRING => {
                    let n = self.u8()?;
                    let b = self.take(n as usize)?;
                    self.push_node(Node::Str(b.iter().map(|&c| c as char).collect()))?
                }
                op::BINBYTES => {
                    let n = self.u32()?;
                    let b = self.take_len(n as u64)?;
                    self.push_node(Node::Bytes(b.to_vec()))?
                }
                op::SHORT_BINBYTES => {
                    let n = self.u8()?;
                    let b = self.take(n as usize)?;
                    self.push_node(Node::Bytes(b.to_vec()))?
                }
                op::BINBYTES8 | op::BYTEARRAY8 => {
                    let n = self.u64()?;
                    let b = self.take_len(n)?;
                    self.push_node(Node::Bytes(b.to_vec()))?
                }
                op::EMPTY_TUPLE => self.push_node(Node::Tuple(Vec::new()))?,
                op::TUPLE1 => {
                    let a = self.pop()?;
                    self.push_node(Node::Tuple(vec![a]))?
                }
                op::TUPLE2 => {
                    let b = self.pop()?;
                    let a = self.pop()?;
                    self.push_node(Node::Tuple(vec![a, b]))?
                }
                op::TUPLE3 => {
                    let c = self.pop()?;
                    let b = self.pop()?;
                    let a = self.pop()?;
                    self.push_node(Node::Tuple(vec![a, b, c]))?
                }
                op::TUPLE => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::Tuple(items))?
                }
                op::EMPTY_LIST => self.push_node(Node::List(Vec::new()))?,
                op::LIST => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::List(items))?
                }
                op::EMPTY_DICT => self.push_node(Node::Dict(Vec::new()))?,
                op::DICT => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    self.push_node(Node::Dict(pairs))?
                }
                op::EMPTY_SET => self.push_node(Node::Set(Vec::new()))?,
                op::FROZENSET => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::Set(items))?
                }
                op::APPEND => {
                    let v = self.pop()?;
                    let target = self.top()?;
                    self.extend_list(target, vec![v])?;
                }
                op::APPENDS => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    self.extend_list(target, items)?;
                }
                op::SETITEM => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let target = self.top()?;
                    self.extend_dict(target, vec![(k, v)])?;
                }
                op::SETITEMS => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    let target = self.top()?;
                    self.extend_dict(target, pairs)?;
                }
                op::ADDITEMS => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    match &mut self.nodes[target] {
                        Node::Set(s) => s.extend(items),
                        _ => return Err(self.malformed("ADDITEMS on something not a set")),
                    }
                }
                op::PUT => {
                    let line = self.line()?;
                    let key: u64 = line
                        .parse()
                        .map_err(|_| self.malformed(format!("bad PUT index `{line}`")))?;
                    self.memo_put(key)?
                }
                op::BINPUT => {
                    let key = self.u8()? as u64;
                    self.memo_put(key)?
                }
                op::LONG_BINPUT => {
                    let key = self.u32()? as u64;
                    self.memo_put(key)?
                }
                op::MEMOIZE => {
                    let key = self.memo.len() as u64;
                    self.memo_put(key)?
                }
                op::GET => {
                    let line = self.line()?;
                    let key: u64 = line
                        .parse()
                        .map_err(|_| self.malformed(format!("bad GET index `{line}`")))?;
                    self.memo_get(key)?
                }
                op::BINGET => {
                    let key = self.u8()? as u64;
                    self.memo_get(key)?
                }
                op::LONG_BINGET => {
                    let key = self.u32()? as u64;
                    self.memo_get(key)?
                }
                op::GLOBAL => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let g = self.global(module, name)?;
                    self.push_node(Node::Global(g))?
                }
                op::STACK_GLOBAL => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Some(module), Some(name)) = (self.str_of(module), self.str_of(name))
                    else {
                        return Err(self.malformed("STACK_GLOBAL needs two strings"));
                    };
                    let g = self.global(module, name)?;
                    self.push_node(Node::Global(g))?
                }
                op::REDUCE => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let node = self.reduce(callable, args)?;
                    self.push_node(node)?
                }
                op::NEWOBJ => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let class = self.class_of(cls, "NEWOBJ")?;
                    let args = self.tuple_items(args, "NEWOBJ")?;
                    self.push_node(Node::Object(ObjNode {
                        class,
                        construct: Construct::NewObj,
                        args,
                        state: None,
                        list_items: Vec::new(),
                        dict_items: Vec::new(),
                    }))?
                }
                op::BUILD => {
                    let state = self.pop()?;
                    let target = self.top()?;
                    self.build(target, state)?;
                }
                op::BINPERSID => {
                    let pid = self.pop()?;
                    self.push_node(Node::PersistentId(pid))?
                }
                op::PERSID => {
                    let line = self.line()?.to_string();
                    let pid = self.add(Node::Str(line));
                    self.push_node(Node::PersistentId(pid))?
                }
                op::NEWOBJ_EX => {
                    return Err(PickleError::Unsupported {
                        name: "NEWOBJ_EX",
                        at: self.op_at,
                        why: "keyword-argument construction is not used by checkpoint classes",
                    });
                }
                op::INST | op::OBJ => {
                    return Err(PickleError::Unsupported {
                        name: "INST/OBJ",
                        at: self.op_at,
                        why: "protocol 0/1 object construction; re-save with protocol >= 2",
                    });
                }
                op::STRING | op::UNICODE => {
                    return Err(PickleError::Unsupported {
                        name: "STRING/UNICODE",
                        at: self.op_at,
                        why: "protocol 0 text strings; re-save with protocol >= 2",
                    });
                }
                op::EXT1 | op::EXT2 | op::EXT4 => {
                    return Err(PickleError::Unsupported {
                        name: "EXT",
                        at: self.op_at,
                        why: "the copyreg extension registry is not available",
                    });
                }
                op::NEXT_BUFFER | op::READONLY_BUFFER => {
                    return Err(PickleError::Unsupported {
                        name: "NEXT_BUFFER",
                        at: self.op_at,
                        why: "out-of-band buffers are not part of checkpoint files",
                    });
                }
                other => {
                    return Err(PickleError::UnknownOpcode {
                        op: other,
                        at: self.op_at,
                    });
                }
            }
        }
    }

    fn pairs(&self, items: Vec<Id>) -> Result<Vec<(Id, Id)>, PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.malformed("odd number of items for a dict"));
        }
        Ok(items.chunks_exact(2).map(|p| (p[0], p[1])).collect())
    }

    fn extend_list(&mut self, target: Id, items: Vec<Id>) -> Result<(), PickleError> {
        match &mut self.nodes[target] {
            Node::List(l) => l.extend(items),
            Node::Object(o) => o.list_items.extend(items),
            _ => return Err(self.malformed("APPEND to something not a list")),
        }
        Ok(())
    }

    fn extend_dict(&mut self, target: Id, pairs: Vec<(Id, Id)>) -> Result<(), PickleError> {
        match &mut self.nodes[target] {
            Node::Dict(d) => d.extend(pairs),
            Node::Object(o) => o.dict_items.extend(pairs),
            _ => return Err(self.malformed("SETITEM on something not a dict")),
        }
        Ok(())
    }

    fn build(&mut self, target: Id, state: Id) -> Result<(), PickleError> {
        let new_pairs = match &self.nodes[state] {
            Node::Dict(p) => Some(p.clone()),
            _ => None,
        };
        let at = self.op_at;
        let mut merged = None;
        match &mut self.nodes[target] {
            Node::Object(o) => match (o.state, new_pairs) {
                // A second BUILD with a dict updates the attributes, as `__dict__.update` does.
                (Some(old), Some(pairs)) => merged = Some((old, pairs)),
                _ => o.state = Some(state),
            },
            _ => {
                return Err(PickleError::Malformed {
                    at,
                    msg: "BUILD on something not an object".into(),
                });
            }
        }
        if let Some((old, pairs)) = merged {
            match &mut self.nodes[old] {
                Node::Dict(d) => d.extend(pairs),
                _ => {
                    if let Node::Object(o) = &mut self.nodes[target] {
                        o.state = Some(state);
                    }
                }
            }
        }
        Ok(())
    }

    fn class_of(&self, id: Id, opname: &str) -> Result<Global, PickleError> {
        match &self.nodes[id] {
            Node::Global(g) if is_constructible(g) => Ok(*g),
            Node::Global(g) => {
                Err(self.malformed(format!("{opname} of `{g}`, which is not a class")))
            }
            _ => Err(self.malformed(format!("{opname} of something that is not a global"))),
        }
    }

    fn tuple_items(&self, id: Id, opname: &str) -> Result<Vec<Id>, PickleError> {
        match &self.nodes[id] {
            Node::Tuple(items) => Ok(items.clone()),
            _ => Err(self.malformed(format!("{opname} arguments are not a tuple"))),
        }
    }

    /// `callable(*args)`: folds the builtin constructions into plain values, describes the rest.
    fn reduce(&mut self, callable: Id, args: Id) -> Result<Node, PickleError> {
        let g = match &self.nodes[callable] {
            Node::Global(g) => *g,
            _ => return Err(self.malformed("REDUCE of something that is not a global")),
        };
        let args = self.tuple_items(args, "REDUCE")?;
        let arg = |i: usize| args.get(i).copied();
        if g == Global::ORDERED_DICT {
            let pairs = match arg(0).map(|a| &self.nodes[a]) {
                None => Vec::new(),
                Some(Node::List(items)) | Some(Node::Tuple(items)) => {
                    let mut pairs = Vec::with_capacity(items.len());
                    for item in items {
                        match &self.nodes[*item] {
                            Node::Tuple(kv) if kv.len() == 2 => pairs.push((kv[0], kv[1])),
                            _ => return Err(self.malformed("OrderedDict item is not a pair")),
                        }
                    }
                    pairs
                }
                Some(_) => return Err(self.malformed("OrderedDict argument is not a list")),
            };
            return Ok(Node::Dict(pairs));
        }
        if g == Global::CODECS_ENCODE {
            let (Some(s), Some(enc)) = (
                arg(0).and_then(|a| self.str_of(a)),
                arg(1).and_then(|a| self.str_of(a)),
            ) else {
                return Err(self.malformed("_codecs.encode needs (str, encoding)"));
            };
            if enc != "latin1" && enc != "latin-1" {
                return Err(self.malformed(format!("_codecs.encode with encoding `{enc}`")));
            }
            let mut bytes = Vec::with_capacity(s.len());
            for c in s.chars() {
                let c = u32::from(c);
                if c > 0xff {
                    return Err(self.malformed("_codecs.encode: character outside latin-1"));
                }
                bytes.push(c as u8);
            }
            return Ok(Node::Bytes(bytes));
        }
        if g == Global::BUILTIN_SET || g == Global::BUILTIN_FROZENSET {
            return match arg(0).map(|a| &self.nodes[a]) {
                None => Ok(Node::Set(Vec::new())),
                Some(Node::List(items)) | Some(Node::Tuple(items)) | Some(Node::Set(items)) => {
                    Ok(Node::Set(items.clone()))
                }
                Some(_) => Err(self.malformed("set argument is not a list")),
            };
        }
        if g == Global::BUILTIN_BYTEARRAY {
            return match arg(0).map(|a| &self.nodes[a]) {
                None => Ok(Node::Bytes(Vec::new())),
                Some(Node::Bytes(b)) => Ok(Node::Bytes(b.clone())),
                Some(_) => Err(self.malformed("bytearray argument is not bytes")),
            };
        }
        if g == Global::GET_LAYOUT {
            let name = arg(0).and_then(|a| self.str_of(a)).unwrap_or("");
            let layout = name
                .strip_prefix("torch.")
                .and_then(|n| Global::lookup("torch", n))
                .filter(|l| l.is_layout())
                .ok_or_else(|| self.malformed(format!("unknown layout `{name}`")))?;
            return Ok(Node::Global(layout));
        }
        if !is_constructible(&g) {
            return Err(self.malformed(format!("REDUCE of `{g}`, which is not callable")));
        }
        Ok(Node::Object(ObjNode {
            class: g,
            construct: Construct::Reduce,
            args,
            state: None,
            list_items: Vec::new(),
            dict_items: Vec::new(),
        }))
    }

    fn to_value(
        &self,
        id: Id,
        depth: usize,
        budget: &mut usize,
        cap: usize,
    ) -> Result<Value, PickleError> {
        if depth > self.limits.max_depth {
            return Err(PickleError::Limit {
                what: "levels of nesting (or a reference cycle)",
                limit: self.limits.max_depth,
            });
        }
        if *budget == 0 {
            return Err(PickleError::Limit {
                what: "values",
                limit: cap,
            });
        }
        *budget -= 1;
        let d = depth + 1;
        let seq = |items: &[Id], budget: &mut usize| -> Result<Vec<Value>, PickleError> {
            items
                .iter()
                .map(|i| self.to_value(*i, d, budget, cap))
                .collect()
        };
        let pairs =
            |items: &[(Id, Id)], budget: &mut usize| -> Result<Vec<(Value, Value)>, PickleError> {
                items
                    .iter()
                    .map(|(k, v)| {
                        Ok((
                            self.to_value(*k, d, budget, cap)?,
                            self.to_value(*v, d, budget, cap)?,
                        ))
                    })
                    .collect()
            };
        Ok(match &self.nodes[id] {
            Node::None => Value::None,
            Node::Bool(b) => Value::Bool(*b),
            Node::Int(i) => Value::Int(*i),
            Node::BigInt(b) => Value::BigInt(b.clone()),
            Node::Float(f) => Value::Float(*f),
            Node::Str(s) => Value::Str(s.clone()),
            Node::Bytes(b) => Value::Bytes(b.clone()),
            Node::Tuple(items) => Value::Tuple(seq(items, budget)?),
            Node::List(items) => Value::List(seq(items, budget)?),
            Node::Set(items) => Value::Set(seq(items, budget)?),
            Node::Dict(items) => Value::Dict(pairs(items, budget)?),
            Node::Global(g) => Value::Global(*g),
            Node::PersistentId(pid) => {
                Value::PersistentId(Box::new(self.to_value(*pid, d, budget, cap)?))
            }
            Node::Object(o) => Value::Object(Box::new(Object {
                class: o.class,
                construct: o.construct,
                args: seq(&o.args, budget)?,
                state: match o.state {
                    Some(s) => Some(self.to_value(s, d, budget, cap)?),
                    None => None,
                },
                list_items: seq(&o.list_items, budget)?,
                dict_items: pairs(&o.dict_items, budget)?,
            })),
        })
    }
}

/// Globals that REDUCE/NEWOBJ may "call" (describe a call of); dtypes, storage classes and
/// layouts are only ever referenced.
fn is_constructible(g: &Global) -> bool {
    g.module.starts_with("torch.distributed.checkpoint.")
        || g.module == "pathlib"
        || *g == Global::TORCH_SIZE
        || *g == Global::TORCH_DEVICE
        || *g == Global::REBUILD_TENSOR_V2
        || *g == Global::REBUILD_PARAMETER
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pickle::{Protocol, pickle};
    use proptest::prelude::*;

    /// A pickle shaped like DCP metadata, to mutate.
    fn sample() -> Vec<u8> {
        let chunk = Value::Object(Box::new(Object::new_with_state(
            Global::CHUNK_STORAGE_METADATA,
            Value::Dict(vec![
                (
                    Value::str("offsets"),
                    Value::Tuple(vec![Value::Int(0), Value::Int(70000)]),
                ),
                (
                    Value::str("sizes"),
                    Value::Tuple(vec![Value::Int(3), Value::Int(-1)]),
                ),
            ]),
        )));
        let v = Value::Dict(vec![
            (
                Value::str("chunks"),
                Value::List(vec![chunk.clone(), chunk]),
            ),
            (Value::str("f"), Value::Float(1.5)),
            (Value::str("b"), Value::Bytes(vec![1, 2, 3])),
            (Value::str("layout"), Value::Global(Global::TORCH_STRIDED)),
            (Value::str("big"), Value::Int(1 << 40)),
        ]);
        pickle(&v, Protocol::DEFAULT)
    }

    #[test]
    fn sample_round_trips() {
        assert!(unpickle(&sample()).is_ok());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let s = sample();
        for cut in 0..s.len() {
            assert!(unpickle(&s[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn shared_references_cannot_blow_up() {
        // x = []; then 64 times: x = (x, x). A naive tree would have 2^64 nodes.
        let mut p = vec![0x80, 4, b']'];
        for _ in 0..64 {
            p.extend_from_slice(&[b'2', 0x86]); // DUP, TUPLE2
        }
        p.push(b'.');
        let e = unpickle(&p).unwrap_err();
        assert!(matches!(e, PickleError::Limit { .. }), "{e}");
    }

    #[test]
    fn deep_nesting_and_cycles_are_limited() {
        // 100k nested lists: [[[...]]] built with APPEND.
        let n = 100_000;
        let mut p = vec![0x80, 4];
        p.extend(std::iter::repeat_n(b']', n));
        p.extend(std::iter::repeat_n(b'a', n - 1));
        p.push(b'.');
        assert!(matches!(unpickle(&p), Err(PickleError::Limit { .. })));
        // l = []; l.append(l)
        let p = [0x80, 4, b']', 0x94, b'h', 0, b'a', b'.'];
        assert!(matches!(unpickle(&p), Err(PickleError::Limit { .. })));
    }

    #[test]
    fn huge_lengths_do_not_allocate() {
        for op in [b'X', b'B', 0x8d, 0x8e, 0x96] {
            let mut p = vec![0x80, 4, op];
            p.extend_from_slice(&[0xff; 8]);
            p.push(b'.');
            assert!(
                matches!(unpickle(&p), Err(PickleError::Truncated { .. })),
                "op {op:#x}"
            );
        }
        let limits = Limits {
            max_memo: 2,
            ..Limits::default()
        };
        let p = [0x80, 4, b'N', 0x94, 0x94, 0x94, b'.'];
        assert!(matches!(
            unpickle_with_limits(&p, &limits),
            Err(PickleError::Limit { .. })
        ));
    }

    #[test]
    fn disallowed_globals_are_named() {
        let e = unpickle(b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R.").unwrap_err();
        assert!(e.to_string().contains("`os.system`"), "{e}");
        let e = unpickle(b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93.").unwrap_err();
        assert!(e.to_string().contains("`builtins.eval`"), "{e}");
        // Allowed but not callable: a dtype cannot be REDUCEd.
        assert!(unpickle(b"\x80\x02ctorch\nfloat32\n)R.").is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = unpickle(&data);
        }

        #[test]
        fn mutated_pickles_never_panic(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
            let mut s = sample();
            for (at, b) in edits {
                let n = s.len();
                s[at % n] = b;
            }
            let _ = unpickle(&s);
        }
    }
}
