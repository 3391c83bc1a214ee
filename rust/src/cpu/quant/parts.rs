//! [`QMatrix::from_parts`]: a matrix from already-quantized parts, as pre-quantized checkpoints
//! (AWQ, GPTQ, compressed-tensors) store them once unpacked: integer quants and one affine
//! `(scale, min)` per 32-block. Their `w = s (q - z)` is `s q + (-s z)`, so nothing is re-rounded.

use super::{check_shape, Blocks, QKind, QMatrix, BLOCK};
use crate::error::{CoreError, CoreResult};

impl QMatrix {
    /// `q[rows * cols]` row-major (each `<= kind.max_q()`), `scales` and `mins`
    /// `[rows * cols / 32]` (block `b` of row `r` at `r * cols / 32 + b`): `w = scale * q + min`.
    pub fn from_parts(
        q: &[u8],
        rows: usize,
        cols: usize,
        scales: &[f32],
        mins: &[f32],
        kind: QKind,
    ) -> CoreResult<Self> {
        check_shape(rows, cols)?;
        if kind == QKind::Q6K {
            let r = "q6k matrices come from GGUF Q6_K blocks (from_ggml)";
            return Err(CoreError::invalid("kind", r));
        }
        if q.len() != rows * cols {
            let r = format!(
                "has {} elements, expected rows * cols = {}",
                q.len(),
                rows * cols
            );
            return Err(CoreError::invalid("q", r));
        }
        let nb = rows * cols / BLOCK;
        for (name, v) in [("scales", scales), ("mins", mins)] {
            if v.len() != nb {
                let r = format!(
                    "has {} elements, expected rows * cols / {BLOCK} = {nb}",
                    v.len()
                );
                return Err(CoreError::invalid(name, r));
            }
            if let Some(bad) = v.iter().find(|x| !x.is_finite()) {
                return Err(CoreError::invalid(name, format!("holds {bad}")));
            }
        }
        if let Some(i) = q.iter().position(|&v| v > kind.max_q()) {
            let r = format!(
                "element {i} is {}, above {}'s maximum {}",
                q[i],
                kind.name(),
                kind.max_q()
            );
            return Err(CoreError::invalid("q", r));
        }
        let b = Blocks {
            q: q.to_vec(),
            scale: scales.to_vec(),
            min: mins.to_vec(),
        };
        Ok(Self::pack(rows, cols, kind, &b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_blocks() {
        let (rows, cols) = (19, 64);
        let q: Vec<u8> = (0..rows * cols).map(|i| (i * 7 % 16) as u8).collect();
        let nb = rows * cols / BLOCK;
        // f16 scales times small zero points: f32-exact but not f16 mins, the AWQ/GPTQ case
        let scales: Vec<f32> = (0..nb).map(|i| 0.001 * (i + 1) as f32).collect();
        let mins: Vec<f32> = scales.iter().map(|s| -s * 7.0).collect();
        let m = QMatrix::from_parts(&q, rows, cols, &scales, &mins, QKind::Q4).unwrap();
        let w = m.dequantize();
        for (i, &v) in w.iter().enumerate() {
            let b = i / BLOCK;
            assert_eq!(v, scales[b] * q[i] as f32 + mins[b]);
        }
    }

    #[test]
    fn rejects_bad_parts() {
        let q = vec![16u8; 32];
        let s = [1.0f32];
        let e = QMatrix::from_parts(&q, 1, 32, &s, &s, QKind::Q4)
            .err()
            .unwrap();
        assert!(e.to_string().contains("q"), "{e}");
        assert!(QMatrix::from_parts(&q, 1, 32, &s, &s, QKind::Q8).is_ok());
        assert!(QMatrix::from_parts(&q, 1, 32, &[1.0, 2.0], &s, QKind::Q8).is_err());
        assert!(QMatrix::from_parts(&q, 1, 32, &[f32::NAN], &s, QKind::Q8).is_err());
        assert!(QMatrix::from_parts(&q[..16], 1, 16, &s, &s, QKind::Q8).is_err());
    }
}
