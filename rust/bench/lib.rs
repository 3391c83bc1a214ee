//! Empty: this package exists for its bench target (`benches/core.rs`); see Cargo.toml.
