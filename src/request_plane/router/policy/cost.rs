//! The kv cost of one worker for one request ([`Cost`], with its terms): `kv`'s form and
//! NVIDIA Dynamo's ([`CostForm`]), with the overlap credited per tier and for peer pulls.
//! The formulas and their sources are in the parent module's docs.

use super::{Policy, SelectorConfig, WorkerLoad};

/// The kv cost of one worker for one request, with its terms (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// Leading prompt blocks the worker holds.
    pub overlap_blocks: u32,
    /// Prompt tokens the worker would have to prefill.
    pub uncached_tokens: u32,
    /// The overlap as the cost counted it, in G1 blocks: `overlap_blocks` less the tier
    /// discount of copies below G1, plus the peer-pull credit (the tier credit).
    pub credited_blocks: f64,
    /// The prefill term (see the module docs for each policy's form).
    pub prefill_blocks: f64,
    /// The decode term (blocks, before `kv`'s `decode_weight`).
    pub decode_blocks: f64,
    /// The sum the policy ranks workers by.
    pub cost: f64,
}

/// Which kv cost form (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostForm {
    /// `kv`: the weight on the saving only; every request's blocks are decode load.
    Flotilla,
    /// `dynamo_kv`: the weight on the whole prefill term; shared blocks counted once.
    Dynamo,
}

impl CostForm {
    /// The form `policy` ranks by (`dynamo_kv`: Dynamo's; every other: `kv`'s, which
    /// decisions carry for measurement whatever the policy).
    pub fn of(policy: Policy) -> Self {
        match policy {
            Policy::DynamoKv => CostForm::Dynamo,
            _ => CostForm::Flotilla,
        }
    }
}

/// `ceil(prompt_tokens / block_size)`: the KV blocks a request occupies (`block_size` > 0).
pub fn request_blocks(prompt_tokens: u32, block_size: u32) -> u32 {
    prompt_tokens.div_ceil(block_size)
}

/// The `kv` cost of a worker with `load` holding `overlap_blocks` leading blocks of a prompt
/// of `prompt_tokens` tokens (`config.block_size` > 0).
pub fn kv_cost(
    config: &SelectorConfig,
    prompt_tokens: u32,
    overlap_blocks: u32,
    load: WorkerLoad,
) -> Cost {
    cost_of(
        CostForm::Flotilla,
        config,
        prompt_tokens,
        overlap_blocks,
        0,
        load,
    )
}

/// The cost of a worker under `form`: `overlap_blocks` leading prompt blocks cached there,
/// `active_overlap` leading prompt blocks held by requests in flight there (`dynamo_kv`
/// only), `load` its load (`config.block_size` > 0).
pub fn cost_of(
    form: CostForm,
    config: &SelectorConfig,
    prompt_tokens: u32,
    overlap_blocks: u32,
    active_overlap: u32,
    load: WorkerLoad,
) -> Cost {
    let credited = f64::from(overlap_blocks);
    cost_credited(
        form,
        config,
        prompt_tokens,
        (overlap_blocks, credited),
        active_overlap,
        load,
    )
}

/// [`cost_of`] with the overlap credited per tier: `overlap.0` leading blocks cached in any
/// tier, worth `overlap.1` G1 blocks (below `overlap.0` for copies under G1, above it with
/// blocks pullable from a peer); the prefill term counts the prompt less
/// the credited blocks, [`Cost::uncached_tokens`] the prompt less all cached blocks (what the
/// worker will prefill).
pub fn cost_credited(
    form: CostForm,
    config: &SelectorConfig,
    prompt_tokens: u32,
    overlap: (u32, f64),
    active_overlap: u32,
    load: WorkerLoad,
) -> Cost {
    let (overlap_blocks, credited) = overlap;
    let bs = config.block_size;
    let cached = overlap_blocks.saturating_mul(bs).min(prompt_tokens);
    let uncached = prompt_tokens - cached;
    let credited_uncached =
        f64::from(prompt_tokens) - (credited * f64::from(bs)).min(f64::from(prompt_tokens));
    let queued = load.prefill_tokens as f64;
    let request = u64::from(request_blocks(prompt_tokens, bs));
    let (prefill_blocks, decode_blocks, cost) = match form {
        CostForm::Flotilla => {
            let prefill = (queued + config.overlap_weight * credited_uncached) / f64::from(bs);
            let decode = (load.decode_blocks + request) as f64;
            (prefill, decode, prefill + config.decode_weight * decode)
        }
        CostForm::Dynamo => {
            let prefill = (queued + credited_uncached) / f64::from(bs);
            let new = request.saturating_sub(u64::from(active_overlap));
            let decode = (load.unique_blocks + new) as f64;
            (
                prefill,
                decode,
                config.dynamo_overlap_weight * prefill + decode,
            )
        }
    };
    Cost {
        overlap_blocks,
        uncached_tokens: uncached,
        credited_blocks: credited,
        prefill_blocks,
        decode_blocks,
        cost,
    }
}
