//! Core bookkeeping benches: `cargo bench -p ironlm-bench --bench core` (add `-- --quick` for a fast pass).
//!
//! Each area has one `bench_*` function; add new ones to `criterion_group!` at the bottom.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use ironlm_core::sched::block::{BlockAllocator, BlockId};
use ironlm_core::sched::radix::RadixCache;

const BLOCK_SIZE: usize = 16;
const PROMPT: usize = 4096;
const PROMPT_BLOCKS: usize = PROMPT / BLOCK_SIZE;

/// xorshift64*: deterministic token streams without a dev-dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A 4k-token prompt: one of 8 shared 1k-token system prompts, then a random body, so the
    /// tree has real branching rather than one edge per prompt.
    fn prompt(&mut self) -> Vec<u32> {
        let system = self.next() % 8;
        let mut sys = Rng(system + 1);
        let mut t: Vec<u32> = (0..1024).map(|_| (sys.next() % 32000) as u32).collect();
        t.extend((1024..PROMPT).map(|_| (self.next() % 32000) as u32));
        t
    }
}

fn bench_block(c: &mut Criterion) {
    let mut g = c.benchmark_group("block");
    let mut a = BlockAllocator::new(100_000, BLOCK_SIZE);

    g.bench_function("allocate_free", |b| {
        b.iter(|| {
            let x = a.allocate().unwrap();
            a.decref(black_box(x));
        })
    });

    let seq: Vec<BlockId> = (0..PROMPT_BLOCKS).map(|_| a.allocate().unwrap()).collect();
    g.bench_function("fork_free_256", |b| {
        b.iter(|| {
            a.fork(black_box(&seq));
            a.free_all(black_box(&seq));
        })
    });
    a.free_all(&seq);

    g.bench_function("append_slot_4k_tokens", |b| {
        let mut blocks = Vec::with_capacity(PROMPT_BLOCKS);
        b.iter(|| {
            for t in 0..PROMPT {
                black_box(a.append_slot(&mut blocks, t).unwrap());
            }
            a.free_all(&blocks);
            blocks.clear();
        })
    });
    g.finish();
}

/// A cache holding `cached_blocks` blocks of 4k-token prompts (all released: ref 0, evictable),
/// with an allocator that has one spare prompt's worth of free blocks.
fn filled(cached_blocks: usize, rng: &mut Rng) -> (RadixCache, BlockAllocator, Vec<Vec<u32>>) {
    let mut a = BlockAllocator::new(cached_blocks + 2 * PROMPT_BLOCKS, BLOCK_SIZE);
    let mut r = RadixCache::new(BLOCK_SIZE);
    let mut prompts = Vec::new();
    while r.num_cached_blocks() < cached_blocks {
        let p = rng.prompt();
        cache(&mut r, &mut a, &p);
        prompts.push(p);
    }
    (r, a, prompts)
}

/// Prefill `tokens` into fresh blocks, insert them, adopt the canonical blocks, release.
fn cache(r: &mut RadixCache, a: &mut BlockAllocator, tokens: &[u32]) {
    let blocks: Vec<BlockId> = (0..tokens.len() / BLOCK_SIZE)
        .map(|_| a.allocate().expect("bench pool too small"))
        .collect();
    r.insert(a, tokens, &blocks, None);
    // Adopting the canonical blocks and releasing them nets out to releasing our own: the
    // duplicates go back to the free list, the newly cached ones stay cached.
    a.free_all(&blocks);
}

/// One new prompt in, as many blocks out. Returns (insert time, evict time).
fn churn(r: &mut RadixCache, a: &mut BlockAllocator, rng: &mut Rng) -> (Duration, Duration) {
    let p = rng.prompt();
    let blocks: Vec<BlockId> = (0..PROMPT_BLOCKS).map(|_| a.allocate().unwrap()).collect();
    let t = Instant::now();
    let res = black_box(r.insert(a, &p, &blocks, None));
    let insert = t.elapsed();
    a.free_all(&blocks);
    let new = PROMPT_BLOCKS - res.num_cached_tokens / BLOCK_SIZE;
    let t = Instant::now();
    black_box(r.evict(a, new));
    (insert, t.elapsed())
}

fn bench_radix(c: &mut Criterion) {
    let mut g = c.benchmark_group("radix");
    for size in [10_000, 100_000] {
        let mut rng = Rng(size as u64);
        let (mut r, mut a, prompts) = filled(size, &mut rng);

        // A full hit: the whole prompt is cached (255 of 256 blocks returned).
        let mut i = 0;
        g.bench_with_input(BenchmarkId::new("match_hit_4k", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 1) % prompts.len();
                black_box(r.match_prefix(&prompts[i], None, true))
            })
        });

        // A new prompt: only its 1k-token system prefix is cached.
        let fresh: Vec<Vec<u32>> = (0..64).map(|_| rng.prompt()).collect();
        g.bench_with_input(BenchmarkId::new("match_miss_4k", size), &size, |b, _| {
            b.iter(|| {
                i = (i + 1) % fresh.len();
                black_box(r.match_prefix(&fresh[i], None, true))
            })
        });

        // Re-inserting a cached prompt: the walk that finds every block already there.
        g.bench_with_input(BenchmarkId::new("insert_dup_4k", size), &size, |b, _| {
            let blocks: Vec<BlockId> = vec![0; PROMPT_BLOCKS];
            b.iter(|| {
                i = (i + 1) % prompts.len();
                black_box(r.insert(&mut a, &prompts[i], &blocks, None))
            })
        });

        // Steady state at `size` blocks: insert a new prompt, evict a prompt's worth of the
        // least recently used blocks. Insert and evict are timed separately.
        g.bench_with_input(BenchmarkId::new("insert_new_4k", size), &size, |b, _| {
            b.iter_custom(|iters| (0..iters).map(|_| churn(&mut r, &mut a, &mut rng).0).sum())
        });
        g.bench_with_input(BenchmarkId::new("evict_4k", size), &size, |b, _| {
            b.iter_custom(|iters| (0..iters).map(|_| churn(&mut r, &mut a, &mut rng).1).sum())
        });
    }
    g.finish();
}

/// `n` running sequences in steady decode: 128-token prompts, prefilled untimed.
struct DecodeBench {
    s: ironlm_core::Scheduler,
    n: usize,
    steps: usize,
    tokens: Vec<i64>,
    bt: Vec<i32>,
    round: u64,
}

impl DecodeBench {
    const PROMPT: usize = 128;
    const ROUND: usize = 256;

    fn new(n: usize) -> Self {
        let cfg = ironlm_core::SchedulerConfig {
            block_size: BLOCK_SIZE,
            max_num_seqs: n,
            max_num_batched_tokens: 8192.max(n),
            max_model_len: Self::PROMPT + Self::ROUND + 128,
            num_blocks: n * (Self::PROMPT + Self::ROUND + 128) / BLOCK_SIZE + 64,
            policy: ironlm_core::Policy::Fcfs,
            enable_prefix_caching: true,
            max_queue_len: None,
        };
        let mut rng = Rng(n as u64);
        let tokens = (0..n).map(|_| (rng.next() % 32000) as i64).collect();
        let mut d = Self {
            s: ironlm_core::Scheduler::new(cfg).expect("valid config"),
            n,
            steps: 0,
            tokens,
            bt: Vec::new(),
            round: 0,
        };
        d.refill();
        d
    }

    /// Drop everything and start `n` fresh requests, prefilled (untimed).
    fn refill(&mut self) {
        for i in 0..self.n {
            self.s.abort(&format!("r{}-{i}", self.round));
        }
        self.s.reset_prefix_cache();
        self.round += 1;
        let mut rng = Rng(self.round);
        for i in 0..self.n {
            let prompt: Vec<u32> = (0..Self::PROMPT)
                .map(|_| (rng.next() % 32000) as u32)
                .collect();
            let p = ironlm_core::RequestParams {
                ignore_eos: true,
                // Early sequences decode while later ones still prefill: leave room.
                ..ironlm_core::RequestParams::new(Self::ROUND + 64)
            };
            self.s
                .add_request(&format!("r{}-{i}", self.round), &prompt, p)
                .expect("fits");
        }
        loop {
            let p = self.s.schedule(None);
            let (k, prefill) = (p.num_samples(), p.num_prefill_tokens);
            self.s.update(&self.tokens[..k]).expect("one token per row");
            if prefill == 0 && self.s.num_waiting() == 0 {
                break;
            }
        }
        self.steps = 0;
    }

    /// One decode step as the engine runs it: plan, block tables, update.
    fn step(&mut self) {
        let p = self.s.schedule(None);
        debug_assert_eq!(p.num_decode_tokens, self.n);
        self.bt.resize(p.num_seqs() * p.block_table_width, 0);
        self.s.fill_block_tables(&mut self.bt);
        black_box(self.s.update(&self.tokens).expect("one token per row"));
        self.steps += 1;
    }
}

fn bench_scheduler(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler");
    for n in [64, 256, 1024] {
        let mut d = DecodeBench::new(n);
        g.bench_with_input(BenchmarkId::new("decode_step", n), &n, |b, _| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if d.steps == DecodeBench::ROUND {
                        d.refill();
                    }
                    let t = Instant::now();
                    d.step();
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

/// The CPU decode kernel on one SmolLM2-sized layer: 64 sequences of 32..768 tokens, 9 query
/// heads over 3 KV heads, head_dim 64, pages shuffled across a 4096-block pool. Here, without
/// torch loaded, it runs on scoped std threads, 1 and 2 of them.
fn bench_attention(c: &mut Criterion) {
    use ironlm_core::cpu::attention::{paged_decode, DecodeArgs, DecodeShape};
    let (n, hq, hkv, d, bs, num_blocks) = (64, 9, 3, 64, 16, 4096);
    let mut rng = Rng(11);
    let lens: Vec<i32> = (0..n).map(|_| 32 + (rng.next() % 737) as i32).collect();
    let max_blocks = 48;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let tables: Vec<i32> = ids[..n * max_blocks].to_vec();
    let floats = |rng: &mut Rng, len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect()
    };
    let cache = num_blocks * bs * hkv * d;
    let (q, k, v) = (
        floats(&mut rng, n * hq * d),
        floats(&mut rng, cache),
        floats(&mut rng, cache),
    );
    let args = DecodeArgs {
        shape: DecodeShape {
            num_seqs: n,
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            num_blocks,
            block_size: bs,
            max_blocks,
            kv_stride: hkv * d,
        },
        q: &q,
        q_stride: hq * d,
        k_cache: &k,
        v_cache: &v,
        block_tables: &tables,
        seq_lens: &lens,
        scale: 0.125,
        window: None,
        softcap: None,
        sinks: None,
    };
    let mut out = vec![0.0f32; q.len()];
    let mut g = c.benchmark_group("attention");
    for threads in [1, 2] {
        g.bench_with_input(
            BenchmarkId::new("paged_decode_64seqs", threads),
            &threads,
            |b, &t| b.iter(|| paged_decode(black_box(&args), &mut out, t).unwrap()),
        );
    }
    g.finish();
}

/// The quantized matmul on SmolLM2-135M's shapes, one thread, at M = 1 (decode) and M = 64
/// (a batch): throughput is weight bytes streamed per second.
fn bench_quant(c: &mut Criterion) {
    use criterion::Throughput;
    use ironlm_core::cpu::quant::{MatmulOpts, QMatrix};
    const SHAPES: [(&str, usize, usize); 5] = [
        ("qkv", 576, 960),
        ("o", 576, 576),
        ("gate_up", 576, 3072),
        ("down", 1536, 576),
        ("lm_head", 576, 49152),
    ];
    let mut rng = Rng(5);
    let mut floats = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect()
    };
    let mut g = c.benchmark_group("quant_matmul");
    g.sample_size(10).measurement_time(Duration::from_secs(2));
    for (name, k, n) in SHAPES {
        let w = floats(n * k);
        for bits in [4, 8] {
            let q = QMatrix::quantize(&w, n, k, bits, 32).unwrap();
            g.throughput(Throughput::Bytes(q.nbytes() as u64));
            for m in [1, 64] {
                let x = floats(m * k);
                let mut out = vec![0.0f32; m * n];
                let id = BenchmarkId::new(format!("{name}_{k}x{n}_q{bits}"), format!("m{m}"));
                g.bench_function(id, |b| {
                    b.iter(|| q.matmul(black_box(&x), m, &mut out, &MatmulOpts::default()))
                });
            }
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_block,
    bench_radix,
    bench_scheduler,
    bench_attention,
    bench_quant
);
criterion_main!(benches);
