//! The forward pass on a device, written once over the kernels' [`DeviceOps`] (CUDA through
//! `cudarc`, or the kernels' CPU twins in tests): the model's weights uploaded
//! ([`DeviceModel`]), the step's buffers ([`Workspace`]) and [`forward_pass`], the twin of
//! the CPU pass in `forward.rs`.

use crate::kernels::cuda::pass::{DeviceOps, GemmPrecision, LayerPools};
use crate::kernels::cuda::plan::StepPlan;
use crate::kernels::quant::WeightMatrix;
use crate::kernels::{AttnGeometry, Rope, RopeLayout};
use crate::model::config::ModelConfig;
use crate::model::weights::ModelWeights;

/// One transformer block on the device.
#[derive(Debug)]
pub struct DeviceLayer<O: DeviceOps> {
    pub attn_norm: O::Buf,
    pub wq: O::Mat,
    pub wk: O::Mat,
    pub wv: O::Mat,
    pub bq: Option<O::Buf>,
    pub bk: Option<O::Buf>,
    pub bv: Option<O::Buf>,
    pub wo: O::Mat,
    pub ffn_norm: O::Buf,
    pub w_gate: O::Mat,
    pub w_up: O::Mat,
    pub w_down: O::Mat,
}

/// A model's weights on the device.
#[derive(Debug)]
pub struct DeviceModel<O: DeviceOps> {
    pub config: ModelConfig,
    pub embed: O::Mat,
    pub layers: Vec<DeviceLayer<O>>,
    pub norm: O::Buf,
    /// `None` when tied to `embed`.
    pub lm_head: Option<O::Mat>,
    /// Rows of the output projection (the vocabulary).
    pub vocab: usize,
    pub rope: O::RopeTable,
    pub rope_layout: RopeLayout,
}

impl<O: DeviceOps> DeviceModel<O> {
    /// Uploads every weight (read once from the host model).
    ///
    /// # Errors
    /// The device's (e.g. out of memory).
    pub fn upload(
        ops: &O,
        w: &ModelWeights,
        rope: &Rope,
        precision: GemmPrecision,
    ) -> Result<Self, O::Error> {
        let mat = |m: &WeightMatrix| ops.upload_matrix(m, precision);
        let opt = |b: &Option<Vec<f32>>| b.as_deref().map(|b| ops.upload(b)).transpose();
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(DeviceLayer {
                    attn_norm: ops.upload(&l.attn_norm)?,
                    wq: mat(&l.wq)?,
                    wk: mat(&l.wk)?,
                    wv: mat(&l.wv)?,
                    bq: opt(&l.bq)?,
                    bk: opt(&l.bk)?,
                    bv: opt(&l.bv)?,
                    wo: mat(&l.wo)?,
                    ffn_norm: ops.upload(&l.ffn_norm)?,
                    w_gate: mat(&l.w_gate)?,
                    w_up: mat(&l.w_up)?,
                    w_down: mat(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>, O::Error>>()?;
        Ok(Self {
            config: w.config.clone(),
            embed: mat(&w.embed)?,
            layers,
            norm: ops.upload(&w.norm)?,
            lm_head: w.lm_head.as_ref().map(mat).transpose()?,
            vocab: w.lm_head().rows,
            rope: ops.upload_rope(rope.inv_freq())?,
            rope_layout: rope.layout(),
        })
    }

    fn lm_head(&self) -> &O::Mat {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Activation buffers reused across steps, grown to the largest step seen (tokens for the
/// activations, wanted rows for the logits: a long prefill chunk wants one row, not one per
/// token).
#[derive(Debug)]
pub struct Workspace<O: DeviceOps> {
    /// Tokens the activation buffers hold.
    tokens: usize,
    /// Rows the logits buffer holds.
    rows: usize,
    x: O::Buf,
    h: O::Buf,
    q: O::Buf,
    k: O::Buf,
    v: O::Buf,
    att: O::Buf,
    o: O::Buf,
    gate: O::Buf,
    up: O::Buf,
    /// Rows whose logits are wanted (their residual, then normed) and their logits.
    sel: O::Buf,
    normed: O::Buf,
    pub logits: O::Buf,
}

impl<O: DeviceOps> Workspace<O> {
    /// Buffers for steps of up to `tokens` tokens and `rows` wanted logit rows.
    ///
    /// # Errors
    /// The device's.
    pub fn new(
        ops: &O,
        c: &ModelConfig,
        vocab: usize,
        (tokens, rows): (usize, usize),
    ) -> Result<Self, O::Error> {
        let (n, r) = (tokens.max(1), rows.max(1));
        let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        Ok(Self {
            tokens: n,
            rows: r,
            x: ops.zeros(n * c.hidden_size)?,
            h: ops.zeros(n * c.hidden_size)?,
            q: ops.zeros(n * qd)?,
            k: ops.zeros(n * kvd)?,
            v: ops.zeros(n * kvd)?,
            att: ops.zeros(n * qd)?,
            o: ops.zeros(n * c.hidden_size)?,
            gate: ops.zeros(n * c.intermediate_size)?,
            up: ops.zeros(n * c.intermediate_size)?,
            sel: ops.zeros(r * c.hidden_size)?,
            normed: ops.zeros(r * c.hidden_size)?,
            logits: ops.zeros(r * vocab)?,
        })
    }

    /// Grows the buffers for a step of `tokens` tokens and `rows` logit rows (at least
    /// doubling what grows).
    ///
    /// # Errors
    /// The device's.
    pub fn reserve(
        &mut self,
        ops: &O,
        c: &ModelConfig,
        vocab: usize,
        (tokens, rows): (usize, usize),
    ) -> Result<(), O::Error> {
        if tokens > self.tokens || rows > self.rows {
            let grow = |want: usize, have: usize| {
                if want > have {
                    want.max(2 * have)
                } else {
                    have
                }
            };
            let shape = (grow(tokens, self.tokens), grow(rows, self.rows));
            *self = Self::new(ops, c, vocab, shape)?;
        }
        Ok(())
    }
}

/// Runs one step on the device: K/V of the plan's tokens written into `pools`, and the
/// logits of the plan's `logit_rows` left in `ws.logits` (`[logit_rows.len(), vocab]`).
/// The batch must have passed [`crate::model::forward::validate`].
///
/// # Errors
/// The device's; a failed step may have written some of its K/V slots (the scheduler
/// recomputes the sequences of a failed step).
pub fn forward_pass<O: DeviceOps>(
    ops: &O,
    m: &DeviceModel<O>,
    pools: &mut O::Buf,
    pool_elems: usize,
    block_size: usize,
    plan: &StepPlan,
    ws: &mut Workspace<O>,
) -> Result<(), O::Error> {
    let c = &m.config;
    let n = plan.len();
    if n == 0 {
        return Ok(());
    }
    ops.bind()?;
    ws.reserve(ops, c, m.vocab, (n, plan.logit_rows.len()))?;
    let dp = ops.upload_plan(plan, c.hidden_size)?;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (qd, kvd, ffn) = (c.n_heads * hd, c.n_kv_heads * hd, c.intermediate_size);
    let geo = AttnGeometry {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: hd,
        block_size,
    };
    ops.embed(&m.embed, &dp, n, h, &mut ws.x)?;
    for (l, lw) in m.layers.iter().enumerate() {
        let at = LayerPools::of(l, pool_elems);
        ops.rms_norm(&ws.x, &lw.attn_norm, (n, h), c.rms_eps, &mut ws.h)?;
        ops.matmul(&ws.h, n, &lw.wq, &mut ws.q)?;
        ops.matmul(&ws.h, n, &lw.wk, &mut ws.k)?;
        ops.matmul(&ws.h, n, &lw.wv, &mut ws.v)?;
        for (buf, bias, d) in [
            (&mut ws.q, &lw.bq, qd),
            (&mut ws.k, &lw.bk, kvd),
            (&mut ws.v, &lw.bv, kvd),
        ] {
            if let Some(b) = bias {
                ops.add_bias(buf, b, n * d, d)?;
            }
        }
        ops.rope(&mut ws.q, &m.rope, &dp, n, c.n_heads, hd, m.rope_layout)?;
        ops.rope(&mut ws.k, &m.rope, &dp, n, c.n_kv_heads, hd, m.rope_layout)?;
        ops.kv_write(pools, at, &ws.k, &ws.v, &dp, n, kvd)?;
        ops.attention(&ws.q, pools, at, &dp, n, geo, &mut ws.att)?;
        ops.matmul(&ws.att, n, &lw.wo, &mut ws.o)?;
        ops.add(&mut ws.x, &ws.o, n * h)?;
        ops.rms_norm(&ws.x, &lw.ffn_norm, (n, h), c.rms_eps, &mut ws.h)?;
        ops.matmul(&ws.h, n, &lw.w_gate, &mut ws.gate)?;
        ops.matmul(&ws.h, n, &lw.w_up, &mut ws.up)?;
        ops.swiglu(&mut ws.gate, &ws.up, n * ffn)?;
        ops.matmul(&ws.gate, n, &lw.w_down, &mut ws.o)?;
        ops.add(&mut ws.x, &ws.o, n * h)?;
    }
    let rows = plan.logit_rows.len();
    if rows > 0 {
        ops.gather_logit_rows(&ws.x, &dp, rows, h, &mut ws.sel)?;
        ops.rms_norm(&ws.sel, &m.norm, (rows, h), c.rms_eps, &mut ws.normed)?;
        ops.matmul(&ws.normed, rows, m.lm_head(), &mut ws.logits)?;
    }
    Ok(())
}
