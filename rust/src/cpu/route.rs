//! A MoE layer's router on the CPU where its experts run on the core's kernel (float32): the
//! logits `x @ W` and the top-k choice, for the routings without expert groups or a correction
//! bias (Mixtral, OLMoE, Qwen3-MoE, gpt-oss). `MoeBlock` calls it on every step and the fused
//! decode step (`lean.rs`) inside its one call, so a row routes the same whichever path its step
//! takes (each row's logits are a loop over that row alone: the same bits at any batch size).
//! `model/moe/route.py` is the reference for every family and runs everywhere else; the Python
//! tests hold the two to the same choices and weights within float rounding.

use crate::error::{CoreError, CoreResult};

/// How the logits become scores (route.py's `scoring`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// Softmax over all experts, then the top k.
    Softmax,
    /// A sigmoid per expert, then the top k.
    Sigmoid,
    /// The top k of the raw logits, then a softmax over those k (gpt-oss).
    TopkSoftmax,
}

#[derive(Clone, Copy, Debug)]
pub struct Route {
    pub scoring: Scoring,
    pub top_k: usize,
    /// Divide the k weights by their sum (plus `renorm_eps`).
    pub renormalize: bool,
    pub renorm_eps: f32,
    /// The final weights times this (`routed_scaling_factor`).
    pub scaling: f32,
}

impl Route {
    /// `logits` `[t, experts]` (the logit bias already added) -> each row's `top_k` expert ids
    /// (best first) and combine weights, `[t, top_k]` each. Ties go to the lower id; a NaN logit
    /// ranks above every number, as in `torch.topk`.
    pub fn choose(
        &self,
        logits: &[f32],
        experts: usize,
        ids: &mut [i64],
        weights: &mut [f32],
    ) -> CoreResult<()> {
        let k = self.top_k;
        if k == 0 || k > experts || !logits.len().is_multiple_of(experts) {
            let r = format!(
                "top_k {k} of {experts} experts over {} logits",
                logits.len()
            );
            return Err(CoreError::invalid("top_k", r));
        }
        let t = logits.len() / experts;
        if ids.len() != t * k || weights.len() != t * k {
            let r = format!(
                "{} ids and {} weights for {t} x {k}",
                ids.len(),
                weights.len()
            );
            return Err(CoreError::invalid("ids", r));
        }
        let mut scores = vec![0.0f32; experts];
        for ((row, id), w) in logits
            .chunks_exact(experts)
            .zip(ids.chunks_exact_mut(k))
            .zip(weights.chunks_exact_mut(k))
        {
            match self.scoring {
                Scoring::Softmax => softmax(row, &mut scores),
                Scoring::Sigmoid => {
                    for (s, &x) in scores.iter_mut().zip(row) {
                        *s = 1.0 / (1.0 + (-x).exp());
                    }
                }
                Scoring::TopkSoftmax => scores.copy_from_slice(row),
            }
            top(&scores, id);
            for (w, &i) in w.iter_mut().zip(id.iter()) {
                *w = scores[i as usize];
            }
            if self.scoring == Scoring::TopkSoftmax {
                let raw: Vec<f32> = w.to_vec();
                softmax(&raw, w);
            }
            if self.renormalize {
                let sum = w.iter().sum::<f32>() + self.renorm_eps;
                w.iter_mut().for_each(|x| *x /= sum);
            }
            if self.scaling != 1.0 {
                w.iter_mut().for_each(|x| *x *= self.scaling);
            }
        }
        Ok(())
    }
}

fn softmax(x: &[f32], out: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - m).exp();
    }
    let s: f32 = out.iter().sum();
    out.iter_mut().for_each(|o| *o /= s);
}

/// The indices of the `ids.len()` largest of `scores`, largest first.
fn top(scores: &[f32], ids: &mut [i64]) {
    let rank = |i: usize| {
        let v = scores[i];
        if v.is_nan() {
            f32::INFINITY
        } else {
            v
        }
    };
    for slot in 0..ids.len() {
        let taken = &ids[..slot];
        let mut best: Option<usize> = None;
        for i in 0..scores.len() {
            if taken.contains(&(i as i64)) {
                continue;
            }
            // Strictly greater: the lower index keeps a tie; a NaN outranks infinity too.
            if best.is_none_or(|b| rank(i) > rank(b) || (scores[i].is_nan() && !scores[b].is_nan()))
            {
                best = Some(i);
            }
        }
        ids[slot] = best.unwrap_or(0) as i64;
    }
}

/// `logits[t, e] = x[t] · w[:, e] (+ bias[e])` for `w` `[hidden, experts]` row-major (the router's
/// `[in, out]` parameter).
pub fn router_logits(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    hidden: usize,
    logits: &mut [f32],
) -> CoreResult<()> {
    if hidden == 0 || !w.len().is_multiple_of(hidden) || !x.len().is_multiple_of(hidden) {
        let r = format!("{} weights are not rows of hidden = {hidden}", w.len());
        return Err(CoreError::invalid("router", r));
    }
    let e = w.len() / hidden;
    if logits.len() != x.len() / hidden * e || bias.is_some_and(|b| b.len() != e) {
        return Err(CoreError::invalid(
            "router_bias",
            "does not match the experts",
        ));
    }
    for (row, out) in x.chunks_exact(hidden).zip(logits.chunks_exact_mut(e)) {
        out.fill(0.0);
        for (&xv, wr) in row.iter().zip(w.chunks_exact(e)) {
            for (o, &wv) in out.iter_mut().zip(wr) {
                *o += xv * wv;
            }
        }
        if let Some(b) = bias {
            out.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
        }
    }
    Ok(())
}

/// [`router_logits`] then [`Route::choose`] for rows `x` `[t, hidden]`; `logits` `[t, experts]`
/// is scratch.
#[allow(clippy::too_many_arguments)]
pub fn route_rows(
    route: &Route,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    hidden: usize,
    logits: &mut [f32],
    ids: &mut [i64],
    weights: &mut [f32],
) -> CoreResult<()> {
    router_logits(x, w, bias, hidden, logits)?;
    route.choose(logits, w.len() / hidden, ids, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(scoring: Scoring, k: usize, renormalize: bool) -> Route {
        Route {
            scoring,
            top_k: k,
            renormalize,
            renorm_eps: 0.0,
            scaling: 1.0,
        }
    }

    #[test]
    fn picks_the_largest_best_first_and_ties_to_the_lower_id() {
        let logits = [0.5, 2.0, -1.0, 2.0, 0.1, f32::NAN];
        let (mut ids, mut w) = ([0i64; 3], [0.0f32; 3]);
        route(Scoring::Sigmoid, 3, false)
            .choose(&logits, 6, &mut ids, &mut w)
            .unwrap();
        assert_eq!(ids, [5, 1, 3]);
        let (mut ids, mut w) = ([0i64; 2], [0.0f32; 2]);
        route(Scoring::Softmax, 2, false)
            .choose(&logits[..5], 5, &mut ids, &mut w)
            .unwrap();
        assert_eq!(ids, [1, 3]);
        assert!((w[0] - w[1]).abs() < 1e-7 && w[0] > 0.3, "{w:?}");
    }

    #[test]
    fn weights_follow_the_scoring_and_renormalize() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let (mut ids, mut w) = ([0i64; 2], [0.0f32; 2]);
        route(Scoring::TopkSoftmax, 2, false)
            .choose(&logits, 4, &mut ids, &mut w)
            .unwrap();
        assert_eq!(ids, [1, 2]);
        let want = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((w[0] - want).abs() < 1e-6 && (w[0] + w[1] - 1.0).abs() < 1e-6);
        let mut r = route(Scoring::Softmax, 2, true);
        r.scaling = 2.5;
        r.choose(&logits, 4, &mut ids, &mut w).unwrap();
        assert!((w[0] + w[1] - 2.5).abs() < 1e-5, "{w:?}");
        let bad = route(Scoring::Softmax, 5, false).choose(&logits, 4, &mut [0; 5], &mut [0.0; 5]);
        assert!(bad.is_err());
    }

    #[test]
    fn router_logits_are_the_product_plus_bias() {
        let x = [1.0f32, 2.0];
        let w = [1.0f32, 0.0, -1.0, 0.5, 1.0, 2.0]; // [2, 3]
        let mut out = [0.0f32; 3];
        router_logits(&x, &w, Some(&[0.0, 1.0, 0.0]), 2, &mut out).unwrap();
        assert_eq!(out, [2.0, 3.0, 3.0]);
    }
}
