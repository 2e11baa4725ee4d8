//! Python pickle: an allow-list reader ([`unpickle`]) and a writer ([`pickle`]) over [`Value`].

mod globals;
mod read;
mod value;
mod write;

pub use globals::Global;
pub use read::{Limits, PickleError, unpickle, unpickle_with_limits};
pub use value::{Construct, Object, Value};
pub use write::{Protocol, pickle};
