//! Property test: random task graphs (hundreds of tasks over random overlapping views of shared
//! buffers; every tag; nested auto scopes; manual scopes with explicit dependencies; SPMD and
//! sync-start tasks; dummies and predicates; tiny rings that force back-pressure and
//! wrap-around; 1–3 cores; overlapped and serial mode) must leave every buffer exactly as a
//! sequential execution of the same tasks in submit order.
//!
//! The generator adds explicit dependencies only where the runtime does not track them: `NoDep`
//! reads (and writes over bytes that `NoDep` readers may still read), and anything inside a
//! manual scope — exactly the contracts of the unsafe `Task::no_dep` and
//! `Orchestrator::begin_manual_scope`. Everything else — creator edges, read-after-write,
//! write-after-read and write-after-write through the TensorMap, covered-entry retirement — is
//! left to the runtime.
//!
//! The oracle also flags over-serialisation: every TensorMap edge the runtime reports as an
//! exact overlap (covers or partial) must join a producer and a consumer that really share an
//! element, one of them writing it (captured with `dep_gen`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use simpler_core::trace::{DepGraph, EdgeSource, OverlapKind};
use simpler_core::*;
use simpler_cpu::CpuPlatform;

const MIX: KernelId = KernelId(7);
const BUFS: usize = 3;
const ELEMS: u64 = 64; // each user buffer: 8 x 8 f32

/// SplitMix64: a tiny deterministic generator for the program.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Where a view looks: a user buffer or an output of an earlier task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Src {
    User(usize),
    Out(usize), // index of the producing task in program order (one output per producer)
}

#[derive(Clone, Debug)]
enum View {
    Range {
        off: u64,
        len: u64,
    },
    Tile {
        r0: u64,
        r1: u64,
        c0: u64,
        c1: u64,
        transposed: bool,
    },
}

#[derive(Clone, Debug)]
enum Arg {
    Existing { tag: ArgTag, src: Src, view: View },
    Output { len: u64 },
}

#[derive(Clone, Debug)]
struct TaskSpec {
    args: Vec<Arg>,
    c: f32,
    blocks: u32,
    sync: bool,
    skip: bool,
    dummy: bool,
    deps: Vec<usize>,
}

#[derive(Clone, Debug)]
enum Op {
    Begin(ScopeKind),
    End,
    Task(TaskSpec),
}

/// Elements of a view, as (source, element offset) pairs in row-major order of the view.
fn elements(src: Src, view: &View, out_len: &HashMap<usize, u64>) -> Vec<(Src, u64)> {
    let mut v = Vec::new();
    match *view {
        View::Range { off, len } => v.extend((off..off + len).map(|e| (src, e))),
        View::Tile {
            r0,
            r1,
            c0,
            c1,
            transposed,
        } => {
            let _ = out_len;
            if transposed {
                for c in c0..c1 {
                    for r in r0..r1 {
                        v.push((src, r * 8 + c));
                    }
                }
            } else {
                for r in r0..r1 {
                    for c in c0..c1 {
                        v.push((src, r * 8 + c));
                    }
                }
            }
        }
    }
    v
}

fn is_contiguous(view: &View) -> bool {
    match *view {
        View::Range { .. } => true,
        // A transposed tile is dense only when it is a single row (then it is a column vector
        // with unit stride); an upright one when it spans whole rows or is one row.
        View::Tile {
            r0,
            r1,
            c0,
            c1,
            transposed,
        } => r1 - r0 == 1 || (!transposed && c0 == 0 && c1 == 8),
    }
}

struct Program {
    ops: Vec<Op>,
    window: u64,
    heap: u64,
    dep_pool: u64,
}

fn random_view(rng: &mut Rng, len: u64, matrix: bool) -> View {
    if matrix && rng.chance(50) {
        let r0 = rng.below(8);
        let r1 = r0 + 1 + rng.below(8 - r0);
        let c0 = rng.below(8);
        let c1 = c0 + 1 + rng.below(8 - c0);
        View::Tile {
            r0,
            r1,
            c0,
            c1,
            transposed: rng.chance(30),
        }
    } else {
        let off = rng.below(len);
        let n = 1 + rng.below(len - off);
        View::Range { off, len: n }
    }
}

/// Generates a program that honours the unsafe contracts, and ring sizes that can hold it without
/// a provable deadlock (so the rings are as small as they can be).
fn generate(seed: u64, n_tasks: usize, max_blocks: u32) -> Program {
    let mut rng = Rng(seed);
    let mut ops = Vec::new();
    // Scope stack: (kind, depth, tasks submitted directly). Depth 0 is implicit.
    let mut stack: Vec<ScopeKind> = vec![ScopeKind::Auto];
    // Outputs usable now: (task index, len, depth of the scope that owns it).
    let mut outputs: Vec<(usize, u64, usize)> = Vec::new();
    let mut out_len: HashMap<usize, u64> = HashMap::new();
    // Per element: last writer, readers since then and `NoDep` readers since then (task
    // indices).
    let mut last_writer: HashMap<(Src, u64), usize> = HashMap::new();
    let mut readers: HashMap<(Src, u64), Vec<usize>> = HashMap::new();
    let mut nodep_readers: HashMap<(Src, u64), Vec<usize>> = HashMap::new();
    // Every registered reader (Input) per source buffer: writers may wait for any of them.
    let mut readers_ever: HashMap<Src, Vec<usize>> = HashMap::new();
    // Every registered writer (InOut / OutputExisting) per source buffer: the TensorMap may
    // report any of them for a reader whose region it cannot compare exactly, so this bounds
    // the producers of a task from above.
    let mut writers_ever: HashMap<Src, Vec<usize>> = HashMap::new();
    // Ring budget per ring: tasks, bytes and dep entries since the outermost open scope of that
    // ring began, and their maxima.
    let mut since = [(0u64, 0u64, 0u64); 4];
    let mut max = [(0u64, 0u64, 0u64); 4];
    let mut max_block = 0u64;
    let mut task_idx = 0usize;
    let mut depth0_tasks = 0;
    // Most tasks one instance of a scope (with its nested scopes on ring 3) may submit before
    // the generator closes it: small, so the rings stay small and wrap many times.
    let scope_cap = 4 + rng.below(20);
    while task_idx < n_tasks {
        let depth = stack.len() - 1;
        // Scope moves.
        let roll = rng.below(100);
        if roll < 8 && depth < 5 {
            let kind = if *stack.last().unwrap() == ScopeKind::Manual || rng.chance(25) {
                ScopeKind::Manual
            } else {
                ScopeKind::Auto
            };
            stack.push(kind);
            let d = stack.len() - 1;
            if d <= 3 {
                since[d] = (0, 0, 0);
            }
            ops.push(Op::Begin(kind));
            continue;
        }
        if depth > 0 && (roll < 16 || since[depth.min(3)].0 >= scope_cap) {
            stack.pop();
            outputs.retain(|&(_, _, d)| d < depth);
            ops.push(Op::End);
            continue;
        }
        if depth == 0 && depth0_tasks >= 6 {
            // Keep the implicit scope small: its tasks are only released at the end.
            stack.push(ScopeKind::Auto);
            since[1] = (0, 0, 0);
            ops.push(Op::Begin(ScopeKind::Auto));
            continue;
        }
        let manual = *stack.last().unwrap() == ScopeKind::Manual;
        let ring = depth.min(3);
        // Arguments.
        let mut args: Vec<Arg> = Vec::new();
        let mut arg_elems: Vec<(ArgTag, Vec<(Src, u64)>)> = Vec::new();
        let n_args = 1 + rng.below(4);
        for _ in 0..n_args {
            if rng.chance(20) && !args.iter().any(|a| matches!(a, Arg::Output { .. })) {
                let len = 1 + rng.below(32);
                args.push(Arg::Output { len });
                continue;
            }
            let tag = match rng.below(10) {
                0..=3 => ArgTag::Input,
                4..=6 => ArgTag::InOut,
                7..=8 => ArgTag::OutputExisting,
                _ => ArgTag::NoDep,
            };
            let use_out = !outputs.is_empty() && rng.chance(35);
            let (src, view) = if use_out {
                let (t, len, _) = outputs[rng.below(outputs.len() as u64) as usize];
                (Src::Out(t), random_view(&mut rng, len, false))
            } else {
                (
                    Src::User(rng.below(BUFS as u64) as usize),
                    random_view(&mut rng, ELEMS, true),
                )
            };
            let el = elements(src, &view, &out_len);
            // A written argument may not overlap another argument of the task.
            let set: HashSet<(Src, u64)> = el.iter().copied().collect();
            let clash = arg_elems.iter().any(|(t, e)| {
                (t.is_written() || tag.is_written()) && e.iter().any(|x| set.contains(x))
            });
            if clash {
                continue;
            }
            arg_elems.push((tag, el));
            args.push(Arg::Existing { tag, src, view });
        }
        let dummy = rng.chance(5);
        let skip = !dummy && rng.chance(5);
        let written_contig = args.iter().all(|a| match a {
            Arg::Existing { tag, view, .. } => !tag.is_written() || is_contiguous(view),
            Arg::Output { .. } => true,
        });
        let blocks = if written_contig && !dummy && rng.chance(30) {
            1 + rng.below(max_blocks as u64) as u32
        } else {
            1
        };
        // A gang needs as many free cores as blocks: max_blocks is cores + 1.
        let sync = blocks > 1 && blocks < max_blocks && rng.chance(20);
        // Explicit dependencies the unsafe contracts ask for (NoDep, manual scopes).
        let mut deps: HashSet<usize> = HashSet::new();
        let mut producer_bound: HashSet<usize> = HashSet::new();
        for (tag, el) in &arg_elems {
            for e in el {
                if let Src::Out(t) = e.0 {
                    producer_bound.insert(t);
                }
                let lw = last_writer.get(e).copied();
                if tag.is_written() {
                    let untracked = if manual { &readers } else { &nodep_readers };
                    deps.extend(untracked.get(e).map(Vec::as_slice).unwrap_or(&[]));
                    if let Some(w) = lw
                        && manual
                    {
                        deps.insert(w);
                    }
                }
                if matches!(tag, ArgTag::Input | ArgTag::InOut | ArgTag::NoDep)
                    && let Some(w) = lw
                    && (manual || *tag == ArgTag::NoDep)
                {
                    deps.insert(w);
                }
                if *tag != ArgTag::NoDep {
                    producer_bound.extend(writers_ever.get(&e.0).map(Vec::as_slice).unwrap_or(&[]));
                }
                if tag.is_written() {
                    producer_bound.extend(readers_ever.get(&e.0).map(Vec::as_slice).unwrap_or(&[]));
                }
            }
        }
        let mut deps: Vec<usize> = deps.into_iter().collect();
        deps.sort();
        producer_bound.extend(deps.iter().copied());
        // Bookkeeping of reads and writes.
        if !skip && !dummy {
            for (tag, el) in &arg_elems {
                for e in el {
                    if tag.is_written() {
                        last_writer.insert(*e, task_idx);
                        readers.remove(e);
                        nodep_readers.remove(e);
                    } else {
                        readers.entry(*e).or_default().push(task_idx);
                        if *tag == ArgTag::NoDep {
                            nodep_readers.entry(*e).or_default().push(task_idx);
                        }
                    }
                }
            }
        } else {
            // It writes nothing and reads nothing, but it is still a registered writer (InOut,
            // OutputExisting) as far as the runtime's bound on producers goes.
        }
        for (tag, el) in &arg_elems {
            if matches!(tag, ArgTag::InOut | ArgTag::OutputExisting) {
                writers_ever.entry(el[0].0).or_default().push(task_idx);
            }
            if *tag == ArgTag::Input {
                readers_ever.entry(el[0].0).or_default().push(task_idx);
            }
        }
        let mut bytes = 0;
        for a in &args {
            if let Arg::Output { len } = a {
                out_len.insert(task_idx, *len);
                // The output of a task that does not run holds whatever the heap held before:
                // nobody may read it.
                if !skip && !dummy {
                    outputs.push((task_idx, *len, depth));
                }
                bytes += (len * 4).div_ceil(1024) * 1024;
                // Elements of a fresh output: written by this task.
                if !skip && !dummy {
                    for e in 0..*len {
                        last_writer.insert((Src::Out(task_idx), e), task_idx);
                    }
                }
            }
        }
        max_block = max_block.max(bytes);
        since[ring].0 += 1;
        since[ring].1 += bytes;
        since[ring].2 += producer_bound.len() as u64;
        for r in 0..4 {
            max[r].0 = max[r].0.max(since[r].0);
            max[r].1 = max[r].1.max(since[r].1);
            max[r].2 = max[r].2.max(since[r].2);
        }
        if depth == 0 {
            depth0_tasks += 1;
        }
        ops.push(Op::Task(TaskSpec {
            args,
            c: (task_idx % 17) as f32 * 0.25,
            blocks,
            sync,
            skip,
            dummy,
            deps,
        }));
        task_idx += 1;
    }
    while stack.len() > 1 {
        stack.pop();
        ops.push(Op::End);
    }
    let tasks = max.iter().map(|m| m.0).max().unwrap();
    let bytes = max.iter().map(|m| m.1).max().unwrap();
    let deps = max.iter().map(|m| m.2).max().unwrap();
    Program {
        ops,
        window: (tasks + 2).next_power_of_two().max(4),
        heap: (2 * bytes).max(4 * max_block).max(1024).div_ceil(1024) * 1024,
        dep_pool: (deps + 1).max(4),
    }
}

/// The kernel: every written element becomes `old * 0.5 + c + 0.001 * S + 0.01 * j + 0.1 * w`,
/// where `old` is the element's value for InOut (0 otherwise), `S` the f64 sum of every
/// readable argument's elements, `j` the element's row-major index in its view and `w` the
/// written argument's ordinal.
fn value(old: f32, c: f32, s: f64, j: usize, w: usize) -> f32 {
    (old as f64 * 0.5 + c as f64 + 0.001 * s + 0.01 * j as f64 + 0.1 * w as f64) as f32
}

fn mix_kernel(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let c = ctx.scalar_f32(0)?;
    let mut s = 0f64;
    for i in 0..ctx.num_args() {
        if !ctx.arg(i)?.tag.is_written() {
            s += ctx.gather::<f32>(i)?.iter().map(|&x| x as f64).sum::<f64>();
        }
    }
    let mut w = 0;
    for i in 0..ctx.num_args() {
        let a = *ctx.arg(i)?;
        if !a.tag.is_written() {
            continue;
        }
        let in_out = a.tag == ArgTag::InOut;
        if ctx.block_num() == 1 {
            let old = if in_out {
                ctx.gather::<f32>(i)?
            } else {
                vec![0.0; a.tensor.numel() as usize]
            };
            let new: Vec<f32> = old
                .iter()
                .enumerate()
                .map(|(j, &o)| value(o, c, s, j, w))
                .collect();
            ctx.scatter(i, &new)?;
        } else {
            let n = a.tensor.numel() as usize;
            let chunk = n.div_ceil(ctx.block_num());
            let base = ctx.block_idx() * chunk;
            for (k, v) in ctx.write_chunk::<f32>(i, chunk)?.iter_mut().enumerate() {
                let old = if in_out { *v } else { 0.0 };
                *v = value(old, c, s, base + k, w);
            }
        }
        w += 1;
    }
    Ok(())
}

/// Dispatch predicate: run only if scalar 1 is 1 (the generator sets 0 for skipped tasks).
fn run_if_flagged(ctx: &TaskCtx<'_>) -> bool {
    ctx.scalar(1).map(|f| f == 1).unwrap_or(true)
}

/// Sequential execution of the program, in submit order.
fn model(p: &Program) -> Vec<Vec<f32>> {
    model_from(p, (0..BUFS).map(initial).collect())
}

/// The buffers after a sequential execution of `p` over `user`.
fn model_from(p: &Program, mut user: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
    let mut outs: HashMap<usize, Vec<f32>> = HashMap::new();
    let mut idx = 0;
    for op in &p.ops {
        let Op::Task(t) = op else { continue };
        let me = idx;
        idx += 1;
        if t.dummy || t.skip {
            continue;
        }
        let out_len: HashMap<usize, u64> = HashMap::new();
        let get =
            |src: Src, e: u64, user: &Vec<Vec<f32>>, outs: &HashMap<usize, Vec<f32>>| match src {
                Src::User(b) => user[b][e as usize],
                Src::Out(o) => outs[&o][e as usize],
            };
        let mut s = 0f64;
        for a in &t.args {
            if let Arg::Existing { tag, src, view } = a
                && !tag.is_written()
            {
                s += elements(*src, view, &out_len)
                    .iter()
                    .map(|&(src, e)| get(src, e, &user, &outs) as f64)
                    .sum::<f64>();
            }
        }
        let mut w = 0;
        for a in &t.args {
            match a {
                Arg::Existing { tag, src, view } if tag.is_written() => {
                    for (j, (src, e)) in elements(*src, view, &out_len).into_iter().enumerate() {
                        let old = if *tag == ArgTag::InOut {
                            get(src, e, &user, &outs)
                        } else {
                            0.0
                        };
                        let v = value(old, t.c, s, j, w);
                        match src {
                            Src::User(b) => user[b][e as usize] = v,
                            Src::Out(o) => outs.get_mut(&o).unwrap()[e as usize] = v,
                        }
                    }
                    w += 1;
                }
                Arg::Output { len } => {
                    outs.insert(
                        me,
                        (0..*len as usize)
                            .map(|j| value(0.0, t.c, s, j, w))
                            .collect(),
                    );
                    w += 1;
                }
                _ => {}
            }
        }
    }
    user
}

fn initial(b: usize) -> Vec<f32> {
    initial_round(b, 0)
}

/// Buffer `b`'s contents before run `round` (each round different).
fn initial_round(b: usize, round: usize) -> Vec<f32> {
    (0..ELEMS)
        .map(|e| (b as f32 + 1.0) * 0.5 + e as f32 * 0.125 - round as f32 * 0.375)
        .collect()
}

fn make_view(t: &Tensor, view: &View) -> Tensor {
    match *view {
        View::Range { off, len } => t
            .reshape(&[t.numel()])
            .unwrap()
            .slice(0, off, off + len)
            .unwrap(),
        View::Tile {
            r0,
            r1,
            c0,
            c1,
            transposed,
        } => {
            let m = t
                .reshape(&[8, 8])
                .unwrap()
                .slice(0, r0, r1)
                .unwrap()
                .slice(1, c0, c1)
                .unwrap();
            if transposed {
                m.transpose(0, 1).unwrap()
            } else {
                m
            }
        }
    }
}

fn orchestrate(o: &mut Orchestrator, args: &RunArgs, p: &Program) -> Result<(), RunError> {
    let user: Vec<Tensor> = (0..BUFS)
        .map(|b| o.bind(&args.buffers[b], DType::F32, &[ELEMS]))
        .collect::<Result<_, _>>()?;
    let mut ids: Vec<TaskId> = Vec::new();
    let mut outs: HashMap<usize, Tensor> = HashMap::new();
    for op in &p.ops {
        match op {
            Op::Begin(ScopeKind::Manual) => {
                // SAFETY: the generator orders every task of a manual scope explicitly after
                // each live task it must follow (its `deps`).
                unsafe { o.begin_manual_scope()? }
            }
            Op::Begin(kind) => o.begin_scope(*kind)?,
            Op::End => o.end_scope()?,
            Op::Task(t) => {
                let mut task = if t.dummy {
                    Task::dummy()
                } else {
                    Task::new(MIX)
                };
                task = task
                    .scalar_f32(t.c)
                    .scalar(u64::from(!t.skip))
                    .blocks(t.blocks);
                if t.skip {
                    task = task.predicate(run_if_flagged);
                }
                if t.sync {
                    task = task.require_sync_start();
                }
                for a in &t.args {
                    task = match a {
                        Arg::Output { len } => task.output(DType::F32, &[*len]),
                        Arg::Existing { tag, src, view } => {
                            let base = match src {
                                Src::User(b) => user[*b],
                                Src::Out(i) => outs[i],
                            };
                            let v = make_view(&base, view);
                            if *tag == ArgTag::NoDep {
                                // SAFETY: the generator orders a NoDep reader explicitly after
                                // the last writer of its elements, and later writers of them
                                // after it (see `generate`).
                                unsafe { task.no_dep(&v) }
                            } else {
                                task.arg(*tag, &v)
                            }
                        }
                    };
                }
                task = task.after_all(t.deps.iter().map(|&d| ids[d]));
                let s = o.submit(task)?;
                if let Some(&out) = s.outputs.first() {
                    outs.insert(ids.len(), out);
                }
                ids.push(s.id);
            }
        }
    }
    Ok(())
}

fn workers() -> &'static [Worker] {
    static W: OnceLock<Vec<Worker>> = OnceLock::new();
    W.get_or_init(|| {
        (1..=3)
            .map(|cores| {
                let w = Worker::new(
                    CpuPlatform::new(),
                    WorkerConfig {
                        cores: Some(cores),
                        timeouts: None,
                        idle_spin: None,
                    },
                )
                .unwrap();
                w.register_kernel(KernelSpec::new(MIX, "mix", EngineClass::Vector, mix_kernel))
                    .unwrap();
                w
            })
            .collect()
    })
}

fn check(seed: u64, n_tasks: usize, cores: usize, serial: bool) -> Result<(), TestCaseError> {
    check_runs(seed, n_tasks, cores, serial, 0)
}

/// Runs the program (captured when `replays > 0`), then replays it `replays` times over fresh
/// buffer contents; every run must match the sequential model of its contents.
fn check_runs(
    seed: u64,
    n_tasks: usize,
    cores: usize,
    serial: bool,
    replays: usize,
) -> Result<(), TestCaseError> {
    let w = &workers()[cores - 1];
    let p = Arc::new(generate(seed, n_tasks, cores as u32 + 1));
    let expect = model(&p);
    let buffers: Vec<Buffer> = (0..BUFS)
        .map(|b| w.buffer_from(&initial(b)).unwrap())
        .collect();
    let runtime_env = if serial {
        RuntimeEnv {
            ring_task_window: RingValue::All(4096),
            ring_heap: RingValue::All(8 << 20),
            ring_dep_pool: RingValue::All(1 << 16),
        }
    } else {
        RuntimeEnv {
            ring_task_window: RingValue::All(p.window),
            ring_heap: RingValue::All(p.heap),
            ring_dep_pool: RingValue::All(p.dep_pool),
        }
    };
    let cfg = CallConfig {
        runtime_env,
        // Captured for the over-serialisation check; the core writes no files.
        dep_gen: true,
        output_dir: Some("unused-by-the-core".into()),
        mode: if serial {
            OrchMode::Serial
        } else {
            OrchMode::Overlapped
        },
        ..CallConfig::default()
    };
    let prog = p.clone();
    let args = RunArgs {
        buffers: buffers.clone(),
        scalars: vec![],
    };
    let shape = GraphShape::new().with("seed", seed);
    let (report, graph) = if replays == 0 {
        let r = w.run_fn("random", args.clone(), &cfg, move |o, a| {
            orchestrate(o, a, &prog)
        });
        (r, None)
    } else {
        match w.capture_fn("random", args.clone(), &cfg, shape.clone(), move |o, a| {
            orchestrate(o, a, &prog)
        }) {
            Ok((r, g)) => (Ok(r), Some(g)),
            Err(e) => (Err(e), None),
        }
    };
    let report =
        report.map_err(|e| TestCaseError::fail(format!("seed {seed}: run failed: {e}")))?;
    expect_buffers(seed, 0, &p, &buffers, &expect)?;
    prop_assert_eq!(report.counters.tasks as usize, n_tasks);
    check_edges(seed, &p, report.deps.as_ref().expect("dep_gen was on"))?;
    let Some(graph) = graph else { return Ok(()) };
    prop_assert_eq!(graph.tasks().len(), n_tasks);
    prop_assert_eq!(
        &report.graph,
        &GraphMode::Captured {
            fingerprint: graph.fingerprint_hex()
        }
    );
    for round in 1..=replays {
        let init: Vec<Vec<f32>> = (0..BUFS).map(|b| initial_round(b, round)).collect();
        for (b, v) in init.iter().enumerate() {
            buffers[b].write(v).unwrap();
        }
        let r = w
            .replay(&graph, args.clone(), &cfg, &shape)
            .map_err(|e| TestCaseError::fail(format!("seed {seed}: replay {round} failed: {e}")))?;
        prop_assert_eq!(
            &r.graph,
            &GraphMode::Replayed {
                fingerprint: graph.fingerprint_hex()
            }
        );
        prop_assert_eq!(r.counters.tasks as usize, n_tasks);
        prop_assert_eq!(r.counters.edges, report.counters.edges);
        expect_buffers(seed, round, &p, &buffers, &model_from(&p, init))?;
    }
    Ok(())
}

fn expect_buffers(
    seed: u64,
    round: usize,
    p: &Program,
    buffers: &[Buffer],
    expect: &[Vec<f32>],
) -> Result<(), TestCaseError> {
    for (b, want) in expect.iter().enumerate() {
        let got = buffers[b].read::<f32>().unwrap();
        let diff: Vec<(usize, f32, f32)> = got
            .iter()
            .zip(want)
            .enumerate()
            .filter(|(_, (g, w))| g != w)
            .map(|(i, (g, w))| (i, *g, *w))
            .collect();
        prop_assert!(
            diff.is_empty(),
            "seed {} run {} buffer {} differs at (element, got, want) {:?} (window {}, heap {}, pool {})",
            seed,
            round,
            b,
            diff,
            p.window,
            p.heap,
            p.dep_pool
        );
    }
    Ok(())
}

/// Flags over-serialisation: every TensorMap edge reported as an exact overlap must join two
/// tasks that share an element through tracked arguments, at least one of them writing it.
fn check_edges(seed: u64, p: &Program, g: &DepGraph) -> Result<(), TestCaseError> {
    let specs: Vec<&TaskSpec> = p
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Task(t) => Some(t),
            _ => None,
        })
        .collect();
    let index: HashMap<u64, usize> = g.tasks.iter().enumerate().map(|(i, t)| (t.id, i)).collect();
    prop_assert_eq!(index.len(), specs.len());
    let no_len = HashMap::new();
    let tracked = |t: &TaskSpec| -> Vec<(bool, HashSet<(Src, u64)>)> {
        t.args
            .iter()
            .filter_map(|a| match a {
                Arg::Existing { tag, src, view } if *tag != ArgTag::NoDep => Some((
                    tag.is_written(),
                    elements(*src, view, &no_len).into_iter().collect(),
                )),
                _ => None,
            })
            .collect()
    };
    for e in &g.edges {
        if e.source != EdgeSource::Tensormap
            || !matches!(e.overlap, OverlapKind::Covers | OverlapKind::Partial)
        {
            continue;
        }
        let (pi, ci) = (index[&e.pred], index[&e.succ]);
        let (pa, ca) = (tracked(specs[pi]), tracked(specs[ci]));
        let justified = ca.iter().any(|(cw, ce)| {
            pa.iter()
                .any(|(pw, pe)| (*cw || *pw) && !ce.is_disjoint(pe))
        });
        prop_assert!(
            justified,
            "seed {}: task {} waits for task {} ({:?}), but no tracked argument of one shares an element with the other's (one writing it)",
            seed,
            ci,
            pi,
            e.overlap
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn random_graphs_match_sequential_execution(
        seed in any::<u64>(),
        n_tasks in 50usize..300,
        cores in 1usize..=3,
        serial in proptest::bool::weighted(0.1),
    ) {
        check(seed, n_tasks, cores, serial)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// A captured random graph replayed over new buffer contents (tiny rings, so replays place
    /// outputs elsewhere in the heap than the capture did) matches the sequential model.
    #[test]
    fn random_graphs_replay_like_their_captured_run(
        seed in any::<u64>(),
        n_tasks in 50usize..200,
        cores in 1usize..=3,
        serial in proptest::bool::weighted(0.1),
    ) {
        check_runs(seed, n_tasks, cores, serial, 3)?;
    }
}

#[test]
fn the_generator_makes_rings_small_enough_to_wrap() {
    // The point of the tiny rings: most programs must cycle their rings several times.
    let mut wrapped = 0;
    for seed in 0..50 {
        let p = generate(seed, 200, 3);
        if p.window < 64 {
            wrapped += 1;
        }
    }
    let windows: Vec<u64> = (0..50).map(|s| generate(s, 200, 3).window).collect();
    assert!(
        wrapped > 25,
        "only {wrapped} of 50 programs got windows below 64 slots: {windows:?}"
    );
}
