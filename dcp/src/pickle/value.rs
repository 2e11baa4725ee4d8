//! The value tree an unpickled stream turns into, and that the pickle writer emits.

use super::globals::Global;

/// A Python value, as far as checkpoint pickles use them.
///
/// Objects are never instantiated: a class from the allow-list plus its constructor arguments,
/// state and items is all that is kept ([`Object`]). A few builtin constructions are folded into
/// plain values while unpickling (`collections.OrderedDict()` -> [`Value::Dict`],
/// `_codecs.encode(s, "latin1")` -> [`Value::Bytes`], `builtins.set(...)` -> [`Value::Set`],
/// `torch.serialization._get_layout("torch.strided")` -> [`Value::Global`] of `torch.strided`).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer outside `i64`, as LONG1/LONG4 store it: little-endian two's complement.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    /// A dict (or `OrderedDict`) in insertion order.
    Dict(Vec<(Value, Value)>),
    Set(Vec<Value>),
    /// A class, function or constant from the allow-list, referenced but not called.
    Global(Global),
    Object(Box<Object>),
    /// What torch.save's `persistent_id` returned (a storage reference tuple).
    PersistentId(Box<Value>),
}

/// How an [`Object`] was constructed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Construct {
    /// `REDUCE`: `class(*args)`.
    Reduce,
    /// `NEWOBJ`: `class.__new__(class, *args)`.
    NewObj,
}

/// An instance of an allow-listed class, described rather than built.
#[derive(Debug, Clone, PartialEq)]
pub struct Object {
    pub class: Global,
    pub construct: Construct,
    pub args: Vec<Value>,
    /// What `BUILD` passed to `__setstate__` (a dict of attributes for dataclasses).
    pub state: Option<Value>,
    /// Items appended to a list subclass.
    pub list_items: Vec<Value>,
    /// Items set on a dict subclass.
    pub dict_items: Vec<(Value, Value)>,
}

impl Object {
    /// `class.__new__(class)` followed by `BUILD(state)`: how protocol 2+ pickles dataclasses.
    pub fn new_with_state(class: Global, state: Value) -> Object {
        Object {
            class,
            construct: Construct::NewObj,
            args: Vec::new(),
            state: Some(state),
            list_items: Vec::new(),
            dict_items: Vec::new(),
        }
    }

    /// `class(*args)`.
    pub fn reduce(class: Global, args: Vec<Value>) -> Object {
        Object {
            class,
            construct: Construct::Reduce,
            args,
            state: None,
            list_items: Vec::new(),
            dict_items: Vec::new(),
        }
    }

    /// The attribute `name` of a dataclass-like object whose state is a dict.
    pub fn attr(&self, name: &str) -> Option<&Value> {
        match &self.state {
            Some(Value::Dict(items)) => items
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            Value::Int(0) => Some(false),
            Value::Int(1) => Some(true),
            _ => None,
        }
    }

    pub fn as_object(&self) -> Option<&Object> {
        match self {
            Value::Object(o) => Some(o),
            _ => None,
        }
    }

    /// The elements of a tuple or list.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    pub fn str(s: impl Into<String>) -> Value {
        Value::Str(s.into())
    }

    /// A short human name of the value's kind, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(_) => "tuple",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
            Value::Set(_) => "set",
            Value::Global(_) => "global",
            Value::Object(_) => "object",
            Value::PersistentId(_) => "persistent id",
        }
    }
}
