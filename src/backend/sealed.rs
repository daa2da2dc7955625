//! The seal of the crate's connection traits: a supertrait no other crate
//! can name, so only this crate implements them.

pub trait Sealed {}
