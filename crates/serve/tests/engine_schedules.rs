//! Random schedules on the engine: requests arriving at random steps, with prompts that share
//! whole and partial KV blocks (so the prefix cache hits), random output lengths, an EOS id
//! some of them generate, aborts and stops at random moments (before a request starts,
//! mid-prefill, mid-decode, after it finished), sampled requests beside greedy ones, and a
//! pool small enough that requests are preempted. After every case: each greedy request that
//! ended by itself gave the tokens it gives alone (but where two logits tie to rounding, see
//! [`TIE`]) and ended for the right reason; an aborted or stopped one gave a prefix of them and
//! never appeared again; every block is free again and a prompt needing the whole pool still
//! runs; the engine's counters add up. The engine never fails a step or runs past a bound.
//!
//! `PROPTEST_CASES=300 PROPTEST_RNG_SEED=7 cargo test --release -p simpler-serve --test
//! engine_schedules -- --nocapture` explores further (about 80 s on two cores).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use half::bf16;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use simpler_core::{CallConfig, Worker};
use simpler_models::qwen3::golden::PrefillChunk;
use simpler_models::qwen3::weights::PAGE_SIZE;
use simpler_models::qwen3::{
    KvBuffers, PagedBatch, Qwen3Config, Qwen3Weights, ResidentModel, Session, WeightFormat,
    generate_weights,
};
use simpler_serve::{Engine, EngineConfig, FinishReason, Request, RequestId, SamplingParams};

/// Longest sequence of the reference engines (and of the engines under test unless a case
/// picks a shorter one).
const MAX_SEQ: usize = 1024;

/// The longest prompt of a schedule: the smallest engine here holds 350 tokens a sequence.
const MAX_PROMPT: usize = 340;

/// How much the test model's `o_proj` and `q_norm`/`k_norm` are scaled ([`weights`]).
const WO_GAIN: f32 = 100.0;
const QK_GAIN: f32 = 2.0;

/// Prompt lengths taken from a shared base sequence: none, partial blocks, and one token
/// either side of each block boundary.
const SHARED: [usize; 10] = [0, 64, 127, 128, 129, 200, 255, 256, 257, 300];

/// The tiny model's weights (seed 21, an untied head so greedy decoding does not just repeat
/// the input token), made once for every engine of this file, with attention that counts:
/// the fixture's `o_proj` is so small that the next token hardly depends on any but the last
/// one (a block of wrong K/V moves the logits by about 1e-3, rarely a token), so it is scaled
/// up and the attention sharpened, so that wrong K/V changes tokens.
fn weights() -> &'static Qwen3Weights {
    static W: OnceLock<Qwen3Weights> = OnceLock::new();
    W.get_or_init(|| {
        let mut c = Qwen3Config::preset("tiny").unwrap();
        c.tie_word_embeddings = false;
        let mut w = generate_weights(&c, 21, false, None);
        for layer in &mut w.layers {
            let layer = Arc::make_mut(layer);
            for x in &mut layer.wo {
                *x = bf16::from_f32(x.to_f32() * WO_GAIN);
            }
            for x in layer.q_norm.iter_mut().chain(&mut layer.k_norm) {
                *x *= QK_GAIN;
            }
        }
        w
    })
}

/// A 2-core worker with the Qwen3 kernels.
fn worker() -> Worker {
    common::qwen3_worker()
}

fn engine(cfg: EngineConfig, eos: Vec<u32>) -> Engine {
    Engine::new(worker(), weights(), eos, cfg).unwrap()
}

fn greedy(prompt: Vec<u32>, max_new_tokens: usize, ignore_eos: bool) -> Request {
    Request {
        prompt,
        max_new_tokens,
        sampling: SamplingParams::default(),
        ignore_eos,
    }
}

/// How far below the reference's best logit a token the engine picked may be. The engine's
/// paths (decode, prefill beside other rows, chunked or cached prompts, recomputation) agree
/// with the reference to rounding, so where two logits nearly tie the engine can take the
/// other one (`docs/serving.md`, "Reproducibility"): on this model about one case in seven
/// takes such a tie, the largest gap seen in 1,300 cases 4e-3. Wrong K/V moves the logits by
/// far more (56 wrong positions of 260: 0.27; the top two are typically 1e-2 to 4e-2 apart),
/// and the wrong token it makes the engine pick is rarely within this of the best.
const TIE: f32 = 1.5e-2;

/// What `prompt` gives served alone: its greedy tokens, one prefill of the whole prompt then
/// one decode a token (as an engine runs one request whose prompt fits its budget), and the
/// logits each token was chosen from.
#[derive(Clone)]
struct Solo {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

/// [`Solo`] of `prompt` for at least `n` tokens, remembered across cases.
fn solo(prompt: &[u32], n: usize) -> Solo {
    static SOLO: OnceLock<Mutex<HashMap<Vec<u32>, Solo>>> = OnceLock::new();
    let mut known = SOLO.get_or_init(Default::default).lock().unwrap();
    if let Some(s) = known.get(prompt)
        && s.tokens.len() >= n
    {
        return s.clone();
    }
    // As many as any request here asks for: one run per prompt.
    let n = n.max(100).min(MAX_SEQ - prompt.len());
    let worker = worker();
    let w = weights();
    let model = ResidentModel::upload_as(&worker, w, MAX_SEQ, WeightFormat::Bf16, None).unwrap();
    let at = |len: usize| PagedBatch::identity(vec![len], MAX_SEQ, PAGE_SIZE);
    let kv = KvBuffers::new(&worker, &w.config, at(1).num_pages(), PAGE_SIZE).unwrap();
    let mut session = Session::new(&worker, Arc::new(model), kv);
    session.read_logits = true;
    let call = CallConfig::default();
    let chunk = PrefillChunk {
        seq: 0,
        tokens: prompt.to_vec(),
        seq_len: prompt.len(),
    };
    let mut out = session
        .prefill(&worker, &at(prompt.len()), &[chunk], &call)
        .unwrap();
    let mut s = Solo {
        tokens: Vec::with_capacity(n),
        logits: Vec::with_capacity(n),
    };
    loop {
        s.tokens.push(out.next_tokens[0]);
        s.logits.push(std::mem::take(&mut out.logits));
        if s.tokens.len() == n {
            break;
        }
        let len = prompt.len() + s.tokens.len();
        out = session
            .decode(&worker, &at(len), &s.tokens[s.tokens.len() - 1..], &call)
            .unwrap();
    }
    drop(session);
    let _ = worker.close();
    known.insert(prompt.to_vec(), s.clone());
    s
}

/// Checks that `got` is what `prompt` gives alone, but for near ties: where the tokens part,
/// the engine's token must be within [`TIE`] of the reference's best logit, and the rest is
/// checked against `prompt` and the tokens through that one served alone. Returns the gaps
/// of the ties taken.
fn check_greedy(prompt: &[u32], got: &[u32]) -> Result<Vec<f32>, String> {
    let mut context = prompt.to_vec();
    let mut rest = got;
    let mut gaps = Vec::new();
    while !rest.is_empty() {
        let alone = solo(&context, rest.len());
        let Some(j) = (0..rest.len()).find(|&j| rest[j] != alone.tokens[j]) else {
            break;
        };
        let l = &alone.logits[j];
        let gap = l[alone.tokens[j] as usize] - l[rest[j] as usize];
        if gap > TIE {
            return Err(format!(
                "after {} tokens of a prompt of {}: {} (logit {}) where alone {} (logit {}); \
                 got {got:?}, alone {:?}",
                context.len() - prompt.len() + j,
                prompt.len(),
                rest[j],
                l[rest[j] as usize],
                alone.tokens[j],
                l[alone.tokens[j] as usize],
                &alone.tokens[..rest.len()]
            ));
        }
        gaps.push(gap);
        context.extend_from_slice(&rest[..=j]);
        rest = &rest[j + 1..];
    }
    Ok(gaps)
}

/// A base sequence prompts share prefixes of (distinct tokens below 997).
fn base(salt: usize) -> Vec<u32> {
    (0..400u32)
        .map(|i| (i * 37 + salt as u32 * 101) % 997)
        .collect()
}

/// How the caller ends a request early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Abort,
    Stop,
}

/// One request of a schedule.
#[derive(Clone, Debug)]
struct Spec {
    /// Which base sequence its prompt starts with, and how much of it.
    base: usize,
    shared: usize,
    /// Its own tail: a salt (equal salts give equal tails) and a length.
    tail_salt: u32,
    tail_len: usize,
    max_new: usize,
    /// The step before which it is added.
    arrive: usize,
    /// Ended by the caller that many steps after it arrives (0: before it ever runs).
    end: Option<(End, usize)>,
    ignore_eos: bool,
    /// Sampled (seeded) rather than greedy: its tokens are not compared, only counted.
    sampled: bool,
}

impl Spec {
    fn prompt(&self) -> Vec<u32> {
        let mut p = base(self.base)[..self.shared].to_vec();
        let tail_len = self.tail_len.min(MAX_PROMPT - self.shared);
        p.extend((0..tail_len as u32).map(|i| (i * 53 + self.tail_salt * 211 + 500) % 1000));
        if p.is_empty() {
            p.push(7);
        }
        p
    }

    fn request(&self) -> Request {
        let sampling = if self.sampled {
            SamplingParams {
                temperature: 0.8,
                top_k: Some(50),
                top_p: 0.9,
                seed: self.arrive as u64,
            }
        } else {
            SamplingParams::default()
        };
        Request {
            prompt: self.prompt(),
            max_new_tokens: self.max_new,
            sampling,
            ignore_eos: self.ignore_eos,
        }
    }
}

/// One schedule and the engine it runs on.
#[derive(Clone, Debug)]
struct Case {
    specs: Vec<Spec>,
    num_blocks: usize,
    max_batch_size: usize,
    budget: usize,
    long_prefill_threshold: Option<usize>,
    max_seq_len: usize,
    /// The EOS id: the token at this position of this request's solo output (none: no EOS).
    eos_from: Option<(usize, usize)>,
}

fn spec() -> impl Strategy<Value = Spec> {
    let end = prop_oneof![
        2 => Just(None),
        1 => (
            prop_oneof![Just(End::Abort), Just(End::Stop)],
            prop_oneof![1 => 0usize..=2, 2 => 0usize..=120],
        )
            .prop_map(Some),
    ];
    (
        (
            prop_oneof![3 => Just(0usize), 1 => Just(1)],
            prop_oneof![
                2 => Just(0),
                1 => Just(PAGE_SIZE),
                1 => Just(2 * PAGE_SIZE),
                4 => proptest::sample::select(&SHARED[..]),
            ],
            0u32..3,
            prop_oneof![1 => Just(0), 2 => 1usize..=100],
        ),
        (
            1usize..=100,
            prop_oneof![0usize..=8, 0usize..=60],
            end,
            proptest::bool::weighted(0.3),
        ),
        proptest::bool::weighted(0.15),
    )
        .prop_map(
            |((base, shared, tail_salt, tail_len), (max_new, arrive, end, ignore_eos), sampled)| {
                Spec {
                    base,
                    shared,
                    tail_salt,
                    tail_len,
                    max_new,
                    arrive,
                    end,
                    ignore_eos,
                    sampled,
                }
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec(spec(), 1..=10),
        3usize..=5,
        1usize..=8,
        proptest::sample::select(vec![3usize, 16, 64, 200, 1024]),
        proptest::sample::select(vec![None, Some(7), Some(100)]),
        proptest::sample::select(vec![350usize, 384, MAX_SEQ]),
        proptest::option::weighted(0.5, (0usize..7, 0usize..8)),
    )
        .prop_map(
            |(specs, num_blocks, max_batch_size, budget, threshold, max_seq_len, eos_from)| Case {
                specs,
                num_blocks,
                max_batch_size,
                budget,
                long_prefill_threshold: threshold,
                max_seq_len,
                eos_from,
            },
        )
}

/// What the cases covered, so the test knows its schedules reach the paths it is about.
#[derive(Debug, Default)]
struct Coverage {
    cases: usize,
    preemptions: u64,
    prefix_hit_tokens: u64,
    eos_finishes: usize,
    length_finishes: usize,
    /// Requests aborted or stopped after some tokens, and before any.
    ended_mid_way: usize,
    ended_before_a_token: usize,
    /// Aborts and stops of requests that had already ended.
    ended_twice: usize,
    /// Requests that found two blocks or more in the prefix cache, and requests whose whole
    /// prompt (of whole blocks) was cached, so that its last block was computed again.
    deep_hits: usize,
    whole_prompt_hits: usize,
    /// Near ties where the engine took another token than the request alone, and the
    /// largest gap of those.
    ties: usize,
    max_tie_gap: f32,
}

/// Where a request of the schedule is.
#[derive(Debug)]
enum State {
    NotYet,
    Live(RequestId),
    Done(RequestId),
}

/// Runs `c` and checks every invariant; adds what it covered to `cov`.
fn run_case(c: &Case, cov: &mut Coverage) -> Result<(), TestCaseError> {
    let fits = c.max_seq_len.min(c.num_blocks * PAGE_SIZE);
    let prompts: Vec<Vec<u32>> = c.specs.iter().map(Spec::prompt).collect();
    // Tokens a request can generate here: its limit, capped to what fits.
    let caps: Vec<usize> = c
        .specs
        .iter()
        .zip(&prompts)
        .map(|(s, p)| s.max_new.min(fits - p.len()))
        .collect();
    let eos: Vec<u32> = c.eos_from.map_or(vec![], |(r, k)| {
        let r = r % c.specs.len();
        vec![solo(&prompts[r], k + 1).tokens[k]]
    });
    let mut e = engine(
        EngineConfig {
            max_batch_size: c.max_batch_size,
            max_num_batched_tokens: c.budget,
            max_seq_len: c.max_seq_len,
            num_blocks: c.num_blocks,
            long_prefill_threshold: c.long_prefill_threshold,
            weights: WeightFormat::Bf16,
        },
        eos.clone(),
    );
    let n = c.specs.len();
    let mut state: Vec<State> = (0..n).map(|_| State::NotYet).collect();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut index_of: HashMap<RequestId, usize> = HashMap::new();
    let mut aborted = 0u64;
    let mut busy_steps = 0u64;
    // Prompt tokens the completions say came from the cache at their first admission.
    let mut cached_seen = 0u64;
    let last_event = c
        .specs
        .iter()
        .map(|s| s.arrive + s.end.map_or(0, |(_, d)| d))
        .max()
        .unwrap_or(0);
    // Far more steps than any schedule here needs (one token a step, each request recomputed
    // a few times): past it the engine is taken to hang.
    let step_limit = 20_000;
    let mut step = 0usize;
    // The tokens of request `r` once it ended (`finish`: how; `None`: ended by the caller):
    // greedy, those it gives alone but for near ties; an EOS only as the last token, and only
    // as its reason; all its tokens when it ended by length.
    let mut check_ended = |r: usize, got: &[u32], finish: Option<FinishReason>| {
        let s = &c.specs[r];
        let eos_at = got.iter().position(|t| eos.contains(t));
        match finish {
            Some(FinishReason::Eos) => prop_assert!(
                !s.ignore_eos && eos_at == Some(got.len() - 1),
                "request {r} ended by EOS: {got:?}, EOS {eos:?}"
            ),
            Some(FinishReason::Length) => prop_assert!(
                got.len() == caps[r] && (s.ignore_eos || eos_at.is_none()),
                "request {r} ended by length after {} of {}: {got:?}, EOS {eos:?}",
                got.len(),
                caps[r]
            ),
            Some(FinishReason::Stop) => prop_assert!(false, "request {r} stopped by itself"),
            None => prop_assert!(
                got.len() < caps[r] && (s.ignore_eos || eos_at.is_none()),
                "request {r} ended by its caller ran on past its end: {got:?}"
            ),
        }
        if !s.sampled {
            match check_greedy(&prompts[r], got) {
                Ok(gaps) => {
                    cov.ties += gaps.len();
                    cov.max_tie_gap = gaps.into_iter().fold(cov.max_tie_gap, f32::max);
                }
                Err(why) => prop_assert!(false, "request {r}: {why}"),
            }
        }
        Ok(())
    };
    loop {
        for (r, s) in c.specs.iter().enumerate() {
            if s.arrive == step {
                let id = e.add_request(&s.request()).unwrap();
                index_of.insert(id, r);
                state[r] = State::Live(id);
            }
        }
        for (r, s) in c.specs.iter().enumerate() {
            let Some((how, after)) = s.end else { continue };
            if s.arrive + after != step {
                continue;
            }
            match state[r] {
                State::Live(id) => {
                    match how {
                        End::Abort => {
                            prop_assert!(e.abort(id), "abort of live request {r}");
                            aborted += 1;
                        }
                        End::Stop => {
                            let done = e.stop(id);
                            prop_assert!(done.is_some(), "stop of live request {r}");
                            let done = done.unwrap();
                            prop_assert_eq!(done.finish_reason, FinishReason::Stop);
                            prop_assert_eq!(&done.tokens, &got[r]);
                            prop_assert_eq!(done.prompt_tokens, prompts[r].len());
                            cached_seen += done.cached_tokens as u64;
                        }
                    }
                    check_ended(r, &got[r], None)?;
                    if got[r].is_empty() {
                        cov.ended_before_a_token += 1;
                    } else {
                        cov.ended_mid_way += 1;
                    }
                    state[r] = State::Done(id);
                }
                State::Done(id) => {
                    match how {
                        End::Abort => prop_assert!(!e.abort(id), "abort of ended request {r}"),
                        End::Stop => prop_assert!(e.stop(id).is_none(), "stop of ended {r}"),
                    }
                    cov.ended_twice += 1;
                }
                State::NotYet => unreachable!("an end comes at or after the arrival"),
            }
        }
        if step > last_event && !e.has_work() {
            break;
        }
        prop_assert!(step < step_limit, "no end after {step} steps: {e:?}");
        // A step with work runs (or fails); one without is empty and not counted.
        busy_steps += u64::from(e.has_work());
        let out = match e.step() {
            Ok(out) => out,
            Err(err) => return Err(TestCaseError::fail(format!("step {step}: {err}"))),
        };
        let mut seen = Vec::new();
        for o in out {
            let r = index_of.get(&o.id).copied();
            prop_assert!(r.is_some(), "a token for unknown request {}", o.id);
            let r = r.unwrap();
            prop_assert!(
                matches!(state[r], State::Live(_)),
                "a token for request {r}, which has ended"
            );
            prop_assert!(!seen.contains(&r), "two tokens for request {r} in one step");
            seen.push(r);
            got[r].push(o.token);
            match o.finished {
                Some(done) => {
                    state[r] = State::Done(o.id);
                    prop_assert_eq!(&done.tokens, &got[r], "request {}'s completion", r);
                    prop_assert_eq!(done.prompt_tokens, prompts[r].len());
                    prop_assert!(done.cached_tokens < done.prompt_tokens);
                    prop_assert_eq!(done.cached_tokens % PAGE_SIZE, 0);
                    cached_seen += done.cached_tokens as u64;
                    cov.deep_hits += usize::from(done.cached_tokens >= 2 * PAGE_SIZE);
                    cov.whole_prompt_hits += usize::from(
                        done.cached_tokens > 0
                            && done.cached_tokens + PAGE_SIZE == done.prompt_tokens,
                    );
                    check_ended(r, &got[r], Some(done.finish_reason))?;
                    match done.finish_reason {
                        FinishReason::Eos => cov.eos_finishes += 1,
                        FinishReason::Length => cov.length_finishes += 1,
                        FinishReason::Stop => {}
                    }
                }
                None => prop_assert!(
                    got[r].len() < caps[r],
                    "request {r} went past its {} tokens",
                    caps[r]
                ),
            }
        }
        let live = state.iter().filter(|s| matches!(s, State::Live(_))).count();
        prop_assert_eq!(e.running() + e.waiting(), live, "requests in flight");
        prop_assert!(e.running() <= c.max_batch_size);
        prop_assert!(e.free_blocks() <= e.total_blocks());
        step += 1;
    }
    // Every request ended; every block is back.
    prop_assert!(state.iter().all(|s| matches!(s, State::Done(_))));
    prop_assert_eq!(e.free_blocks(), c.num_blocks, "blocks free at the end");
    let s = e.stats();
    prop_assert_eq!(s.aborted, aborted);
    let generated: usize = got.iter().map(Vec::len).sum();
    prop_assert_eq!(s.generated_tokens, generated as u64);
    let with_tokens = got.iter().filter(|g| !g.is_empty()).count() as u64;
    prop_assert!(
        (with_tokens..=n as u64).contains(&s.requests),
        "{} admitted, {with_tokens} with tokens of {n}",
        s.requests
    );
    prop_assert!(s.max_batch <= c.max_batch_size);
    prop_assert!(s.prefix_hit_tokens <= s.prompt_tokens);
    prop_assert!(cached_seen <= s.prefix_hit_tokens);
    prop_assert_eq!(s.steps, busy_steps);
    cov.cases += 1;
    cov.preemptions += s.preemptions;
    cov.prefix_hit_tokens += s.prefix_hit_tokens;
    // Cached blocks may stay, but they must give way: a prompt that needs the whole pool
    // (and starts with a cached prefix) runs, and gives its token alone.
    let mut whole = base(0)[..256.min(fits - 1)].to_vec();
    whole.extend(
        (0..)
            .map(|i: u32| (i * 29 + 3) % 1000)
            .take(fits - 1 - whole.len()),
    );
    let done = e.generate(&[greedy(whole.clone(), 1, true)]);
    prop_assert!(done.is_ok(), "a prompt of the whole pool: {:?}", done.err());
    let done = done.unwrap();
    prop_assert_eq!(done[0].tokens.len(), 1);
    let tie = check_greedy(&whole, &done[0].tokens);
    prop_assert!(tie.is_ok(), "a prompt of the whole pool: {:?}", tie.err());
    prop_assert_eq!(
        e.free_blocks(),
        c.num_blocks,
        "blocks free after the whole pool"
    );
    e.close();
    Ok(())
}

/// The seed of the schedules unless `PROPTEST_RNG_SEED` gives another, and how many cases
/// run unless `PROPTEST_CASES` says: with these the schedules are known to reach every path
/// [`Coverage`] counts.
const SEED: u64 = 2;
const CASES: u32 = 16;

/// Random schedules keep every invariant. A failure prints the smallest schedule proptest
/// found that still fails (rerun it with the seed it was found with).
#[test]
fn random_schedules_give_each_request_its_tokens_alone_and_every_block_back() {
    let defaults = Config::default();
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES);
    // Fixed unless asked otherwise: CI runs the same schedules every time.
    let rng_seed = match defaults.rng_seed {
        RngSeed::Random => RngSeed::Fixed(SEED),
        other => other,
    };
    let mut runner = TestRunner::new(Config {
        cases,
        rng_seed,
        // Reproduced from the seed; nothing written into the source tree.
        failure_persistence: None,
        // A case runs in a fraction of a second; shrinking a failure takes a minute or two.
        max_shrink_iters: 256,
        ..defaults
    });
    let cov = Mutex::new(Coverage::default());
    let result = runner.run(&case(), |c| run_case(&c, &mut cov.lock().unwrap()));
    if let Err(e) = result {
        panic!("{e}");
    }
    let cov = cov.into_inner().unwrap();
    eprintln!("{cov:?}");
    // Schedules that never preempt, hit the cache or end a request early would pass while
    // proving nothing: the default ones are checked to reach all of it (other seeds only
    // report what they reached).
    if rng_seed == RngSeed::Fixed(SEED) && cases >= CASES {
        assert!(cov.preemptions > 0, "{cov:?}");
        assert!(cov.deep_hits > 0 && cov.whole_prompt_hits > 0, "{cov:?}");
        assert!(cov.eos_finishes > 0 && cov.length_finishes > 0, "{cov:?}");
        assert!(
            cov.ended_mid_way > 0 && cov.ended_before_a_token > 0 && cov.ended_twice > 0,
            "{cov:?}"
        );
    }
}
