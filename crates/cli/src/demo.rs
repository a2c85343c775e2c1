//! `simpler run demo`: a small pipeline that does real work on the runtime — a tiled matmul
//! with split-K accumulation, bias + GELU, per-tile column sums and a final reduction, spread
//! over several scopes — checked against a plain reference.

use std::sync::Arc;

use anyhow::{Result, bail};
use simpler_core::{
    DType, EngineClass, KernelError, KernelId, KernelSpec, Orchestrator, RunArgs, RunError,
    ScopeKind, Task, TaskCtx, Worker,
};

const ZERO: KernelId = KernelId(100);
const MATMUL_ACC: KernelId = KernelId(101);
const BIAS_GELU: KernelId = KernelId(102);
const COLSUM: KernelId = KernelId(103);
const REDUCE: KernelId = KernelId(104);

/// Problem size of the demo.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DemoShape {
    pub(crate) m: u64,
    pub(crate) k: u64,
    pub(crate) n: u64,
    pub(crate) tile: u64,
}

fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh())
}

fn zero(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    ctx.write_rows::<f32>(0)?
        .iter_mut()
        .for_each(|r| r.fill(0.0));
    Ok(())
}

/// `C[mt, nt] += A[mt, kt] @ B[kt, nt]` (all tiles are strided views of larger matrices).
fn matmul_acc(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let a = ctx.read_rows::<f32>(0)?;
    let b = ctx.read_rows::<f32>(1)?;
    let mut c = ctx.write_rows::<f32>(2)?;
    for (r, crow) in c.iter_mut().enumerate() {
        let arow = a.row(r);
        for (kk, &av) in arow.iter().enumerate() {
            for (cv, &bv) in crow.iter_mut().zip(b.row(kk)) {
                *cv += av * bv;
            }
        }
    }
    Ok(())
}

/// Y = gelu(C + bias) for one tile.
fn bias_gelu(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let c = ctx.read_rows::<f32>(0)?;
    let bias = ctx.read::<f32>(1)?;
    let mut y = ctx.write_rows::<f32>(2)?;
    for (r, yrow) in y.iter_mut().enumerate() {
        for ((yv, &cv), &bv) in yrow.iter_mut().zip(c.row(r)).zip(bias) {
            *yv = gelu(cv + bv);
        }
    }
    Ok(())
}

/// `partial[n] = sum over the tile's rows of Y[r, n]`.
fn colsum(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let y = ctx.read_rows::<f32>(0)?;
    let mut out = ctx.write_rows::<f32>(1)?;
    let o = out.row(0);
    o.fill(0.0);
    for row in y.iter() {
        for (ov, &v) in o.iter_mut().zip(row) {
            *ov += v;
        }
    }
    Ok(())
}

/// `out[n] = sum over tiles of partial[t, n]`.
fn reduce(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let p = ctx.read_rows::<f32>(0)?;
    let mut out = ctx.write_rows::<f32>(1)?;
    let o = out.row(0);
    o.fill(0.0);
    for row in p.iter() {
        for (ov, &v) in o.iter_mut().zip(row) {
            *ov += v;
        }
    }
    Ok(())
}

/// Registers the demo's kernels and its orchestration (`demo`).
pub(crate) fn register(w: &Worker, shape: DemoShape) -> Result<()> {
    w.register_kernel(KernelSpec::new(ZERO, "zero_f32", EngineClass::Vector, zero))?;
    w.register_kernel(KernelSpec::new(
        MATMUL_ACC,
        "matmul_acc_f32",
        EngineClass::Cube,
        matmul_acc,
    ))?;
    w.register_kernel(KernelSpec::new(
        BIAS_GELU,
        "bias_gelu_f32",
        EngineClass::Vector,
        bias_gelu,
    ))?;
    w.register_kernel(KernelSpec::new(
        COLSUM,
        "colsum_f32",
        EngineClass::Vector,
        colsum,
    ))?;
    w.register_kernel(KernelSpec::new(
        REDUCE,
        "reduce_f32",
        EngineClass::Vector,
        reduce,
    ))?;
    w.register_orchestration("demo", move |o, a| orchestrate(o, a, shape))?;
    Ok(())
}

/// Buffers: `A [m, k]`, `B [k, n]`, `bias [n]`, `partials [m/tile, n]`, `out [n]`.
fn orchestrate(o: &mut Orchestrator, args: &RunArgs, s: DemoShape) -> Result<(), RunError> {
    let DemoShape { m, k, n, tile } = s;
    let a = o.bind(&args.buffers[0], DType::F32, &[m, k])?;
    let b = o.bind(&args.buffers[1], DType::F32, &[k, n])?;
    let bias = o.bind(&args.buffers[2], DType::F32, &[n])?;
    let partials = o.bind(&args.buffers[3], DType::F32, &[m / tile, n])?;
    let out = o.bind(&args.buffers[4], DType::F32, &[1, n])?;
    for mt in 0..m / tile {
        // One scope per row tile: its accumulator and activations are freed when it ends.
        o.scope(ScopeKind::Auto, |o| {
            let acc = o.alloc(DType::F32, &[tile, n])?;
            for nt in 0..n / tile {
                let c = acc.slice(1, nt * tile, (nt + 1) * tile)?;
                o.submit(Task::new(ZERO).output_existing(&c))?;
                for kt in 0..k / tile {
                    let at = a
                        .slice(0, mt * tile, (mt + 1) * tile)
                        .and_then(|t| t.slice(1, kt * tile, (kt + 1) * tile));
                    let bt = b
                        .slice(0, kt * tile, (kt + 1) * tile)
                        .and_then(|t| t.slice(1, nt * tile, (nt + 1) * tile));
                    o.submit(Task::new(MATMUL_ACC).input(&at?).input(&bt?).in_out(&c))?;
                }
            }
            let y = o
                .submit(
                    Task::new(BIAS_GELU)
                        .input(&acc)
                        .input(&bias)
                        .output(DType::F32, &[tile, n]),
                )?
                .output(0);
            let row = partials.slice(0, mt, mt + 1)?;
            o.submit(Task::new(COLSUM).input(&y).output_existing(&row))?;
            Ok(())
        })?;
    }
    o.scope(ScopeKind::Auto, |o| {
        o.submit(Task::new(REDUCE).input(&partials).output_existing(&out))?;
        Ok(())
    })
}

/// Deterministic inputs of the demo.
pub(crate) fn inputs(s: DemoShape) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    let a = (0..s.m * s.k).map(|_| next()).collect();
    let b = (0..s.k * s.n).map(|_| next() * 0.2).collect();
    let bias = (0..s.n).map(|_| next()).collect();
    (a, b, bias)
}

/// The plain reference: sum over rows of gelu(A @ B + bias).
pub(crate) fn reference(s: DemoShape, a: &[f32], b: &[f32], bias: &[f32]) -> Vec<f32> {
    let (m, k, n) = (s.m as usize, s.k as usize, s.n as usize);
    let mut out = vec![0f64; n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f64;
            for kk in 0..k {
                acc += a[i * k + kk] as f64 * b[kk * n + j] as f64;
            }
            out[j] += gelu((acc + bias[j] as f64) as f32) as f64;
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

/// Creates the buffers of a demo run.
impl DemoShape {
    /// Bytes the demo holds on the host: its inputs (generated, then copied into buffers), the
    /// partial sums and the output, and the reference's sums; `None` past 64 bits.
    fn host_bytes(&self) -> Option<u64> {
        let (m, k, n) = (self.m, self.k, self.n);
        let inputs = m
            .checked_mul(k)?
            .checked_add(k.checked_mul(n)?)?
            .checked_add(n)?;
        let outputs = (m / self.tile).checked_mul(n)?.checked_add(n)?;
        // f32 inputs twice (the vectors and their buffers), f32 outputs, f64 reference sums.
        inputs
            .checked_mul(8)?
            .checked_add(outputs.checked_mul(4)?)?
            .checked_add(n.checked_mul(8)?)
    }

    /// Refuses a shape the demo cannot run, naming the flag: a zero size or tile, sizes that
    /// are not multiples of the tile, or more memory than `available` (bytes, and where that
    /// figure comes from) — checked before anything is allocated.
    pub(crate) fn check(&self, available: Option<(u64, String)>) -> Result<()> {
        if self.tile == 0 {
            bail!("--tile 0: give a tile edge of at least 1");
        }
        for (flag, v) in [("--m", self.m), ("--k", self.k), ("--n", self.n)] {
            if v == 0 || !v.is_multiple_of(self.tile) {
                bail!(
                    "{flag} {v}: give a positive multiple of --tile ({})",
                    self.tile
                );
            }
        }
        let need = self.host_bytes();
        if let Some((limit, source)) = available
            && need.is_none_or(|b| b > limit)
        {
            bail!(
                "--m {} --k {} --n {}: the demo's matrices take {} and {source} leaves {}: give smaller sizes",
                self.m,
                self.k,
                self.n,
                need.map_or(
                    "more than 2^64 bytes".to_string(),
                    simpler_core::human_bytes
                ),
                simpler_core::human_bytes(limit)
            );
        }
        if need.is_none() {
            bail!(
                "--m {} --k {} --n {}: the demo's matrices overflow 64 bits",
                self.m,
                self.k,
                self.n
            );
        }
        Ok(())
    }
}

pub(crate) fn run_args(w: &Worker, s: DemoShape) -> Result<(RunArgs, Arc<Vec<f32>>)> {
    s.check(w.memory_available())?;
    let (a, b, bias) = inputs(s);
    let expect = Arc::new(reference(s, &a, &b, &bias));
    let buffers = vec![
        w.buffer_from(&a)?,
        w.buffer_from(&b)?,
        w.buffer_from(&bias)?,
        w.alloc((s.m / s.tile * s.n * 4) as usize)?,
        w.alloc((s.n * 4) as usize)?,
    ];
    Ok((
        RunArgs {
            buffers,
            scalars: vec![],
        },
        expect,
    ))
}

/// Largest |got - expect| relative to max(1, |expect|).
pub(crate) fn max_rel_error(got: &[f32], expect: &[f32]) -> f32 {
    got.iter()
        .zip(expect)
        .map(|(g, e)| (g - e).abs() / e.abs().max(1.0))
        .fold(0.0, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(m: u64, k: u64, n: u64, tile: u64) -> DemoShape {
        DemoShape { m, k, n, tile }
    }

    #[test]
    fn shapes_the_demo_cannot_run_are_refused_naming_the_flag() {
        let room = || Some((1u64 << 30, "MemAvailable".to_string()));
        shape(512, 512, 256, 64).check(room()).unwrap();
        for (s, starts) in [
            (shape(512, 512, 256, 0), "--tile 0"),
            (shape(0, 512, 256, 64), "--m 0"),
            (shape(512, 0, 256, 64), "--k 0"),
            (shape(512, 512, 0, 64), "--n 0"),
            (shape(512, 100, 256, 64), "--k 100"),
            // 2^62 rows: the byte count overflows; 2^20 x 2^20: 8 TiB.
            (
                shape(1 << 62, 64, 64, 64),
                "--m 4611686018427387904 --k 64 --n 64",
            ),
            (shape(1 << 20, 1 << 20, 64, 64), "--m 1048576 --k 1048576"),
        ] {
            let e = s.check(room()).unwrap_err().to_string();
            assert!(e.starts_with(starts), "{s:?}: {e}");
        }
        // Where the memory is not known, only an overflow is refused.
        shape(1 << 20, 1 << 20, 64, 64).check(None).unwrap();
        let e = shape(1 << 62, 1 << 62, 64, 64)
            .check(None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("overflow"), "{e}");
    }
    use simpler_core::{CallConfig, RingValue, RuntimeEnv, WorkerConfig};

    fn check(cores: usize, cfg: CallConfig) {
        let s = DemoShape {
            m: 128,
            k: 64,
            n: 96,
            tile: 32,
        };
        let w = Worker::new(
            simpler_cpu::CpuPlatform::new(),
            WorkerConfig {
                cores: Some(cores),
                timeouts: None,
                idle_spin: None,
            },
        )
        .unwrap();
        register(&w, s).unwrap();
        let (args, expect) = run_args(&w, s).unwrap();
        let out = args.buffers[4].clone();
        w.run("demo", args, &cfg).unwrap();
        let got = out.read::<f32>().unwrap();
        assert!(max_rel_error(&got, &expect) < 1e-4, "{got:?} vs {expect:?}");
    }

    #[test]
    fn demo_matches_the_reference() {
        check(2, CallConfig::default());
        check(
            1,
            CallConfig {
                mode: simpler_core::OrchMode::Serial,
                ..CallConfig::default()
            },
        );
        let tiny = RuntimeEnv {
            ring_task_window: RingValue::All(16),
            ring_heap: RingValue::All(64 << 10),
            ring_dep_pool: RingValue::All(64),
        };
        check(
            3,
            CallConfig {
                runtime_env: tiny,
                ..CallConfig::default()
            },
        );
    }

    #[test]
    fn a_tiny_heap_gives_a_proven_heap_deadlock() {
        let s = DemoShape {
            m: 64,
            k: 32,
            n: 64,
            tile: 32,
        };
        let w = Worker::new(
            simpler_cpu::CpuPlatform::new(),
            WorkerConfig {
                cores: Some(2),
                timeouts: None,
                idle_spin: None,
            },
        )
        .unwrap();
        register(&w, s).unwrap();
        let (args, _) = run_args(&w, s).unwrap();
        let cfg = CallConfig {
            runtime_env: RuntimeEnv {
                ring_heap: RingValue::All(4096),
                ..RuntimeEnv::default()
            },
            ..CallConfig::default()
        };
        let e = w.run("demo", args, &cfg).unwrap_err().to_string();
        assert!(e.contains("HEAP_RING_DEADLOCK"), "{e}");
        assert!(e.contains("CallConfig.runtime_env.ring_heap"), "{e}");
    }
}
