//! CPU kernels where torch is not enough: fused decode attention on the paged cache, the
//! decoder's elementwise ops, and block-quantized matmuls, each compiled for several ISAs and
//! picked at run time (`features`), fanned out on the runtime torch already runs (`parallel`).

pub mod attention;
pub mod decode;
pub mod dense;
pub mod elem;
pub mod features;
pub mod lean;
pub mod ops;
pub mod parallel;
pub mod prefill;
pub mod quant;
pub mod route;
