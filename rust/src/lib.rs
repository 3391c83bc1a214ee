//! ironlm core: the bookkeeping half of the engine.

#[cfg(feature = "python")]
mod py;
