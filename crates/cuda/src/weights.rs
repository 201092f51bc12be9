//! The dense weights on the device, in their packed precision.
//!
//! `dense.bin` is uploaded whole into one allocation; a linear weight is the device address of its
//! words (or floats) plus those of its scales and biases, exactly as packed (no f32 copy). Small
//! vectors (norm weights, conv kernels, `A_log`, `dt_bias`) are decoded to f32 once and uploaded;
//! they are a few MB for the released model. The structure mirrors `cherenkov_cpu::weights`, from
//! which it is built, so both backends bind the same tensors.

use anyhow::{Result, bail};
use cherenkov_cpu::weights as cw;
use cherenkov_model::DType;
use cherenkov_model::store::{Precision, Store};

use crate::gpu::{Arg, BLOCKS_WANTED, DevBuf, Gpu, MAX_STAGED_X, blocks, rows_per_block};

/// A linear weight `[rows, cols]` in device memory.
#[derive(Clone, Copy, Debug)]
pub struct DevLinear {
    pub precision: Precision,
    pub rows: usize,
    pub cols: usize,
    pub data: u64,
    pub scales: u64,
    pub biases: u64,
}

impl DevLinear {
    /// y = W x (x: cols floats, y: rows floats), one warp per row.
    pub fn matvec(&self, gpu: &Gpu, x: u64, y: u64) -> Result<()> {
        // Kernels that stage x cover `rpb` rows per block of 8 warps; the others one row per warp.
        let staged_kernel = match self.precision {
            Precision::Affine { bits, .. } => matches!(bits, 2 | 4 | 8),
            Precision::Float { .. } => true,
        };
        let rpb = rows_per_block(self.rows, BLOCKS_WANTED);
        let (threads, grid) = if staged_kernel {
            (256, (blocks(self.rows, rpb), 1, 1))
        } else {
            (128, (blocks(self.rows * 32, 128), 1, 1))
        };
        let staged = (self.cols * 4) as u32;
        if self.cols * 4 > MAX_STAGED_X {
            bail!("a linear of {} inputs is wider than the kernels' staging limit", self.cols);
        }
        match self.precision {
            Precision::Affine { bits, group_size } => gpu.launch(
                &format!("matvec_q{bits}"),
                grid,
                threads as u32,
                if matches!(bits, 2 | 4 | 8) { staged } else { 0 },
                &[
                    Arg::Ptr(self.data),
                    Arg::Ptr(self.scales),
                    Arg::Ptr(self.biases),
                    Arg::Ptr(x),
                    Arg::Ptr(y),
                    Arg::I32(self.rows as i32),
                    Arg::I32(self.cols as i32),
                    Arg::I32(group_size as i32),
                    Arg::I32(rpb as i32),
                ],
            ),
            Precision::Float { dtype } => gpu.launch(
                "matvec_float",
                grid,
                threads as u32,
                staged,
                &[
                    Arg::Ptr(self.data),
                    Arg::Ptr(x),
                    Arg::Ptr(y),
                    Arg::I32(self.rows as i32),
                    Arg::I32(self.cols as i32),
                    Arg::I32(dtype_code(dtype)?),
                    Arg::I32(rpb as i32),
                ],
            ),
        }
    }

    /// Row `row` (an embedding), written `copies` times into `out`.
    pub fn embed(&self, gpu: &Gpu, row: u32, out: u64, copies: usize) -> Result<()> {
        let (dtype, bits, gs) = match self.precision {
            Precision::Affine { bits, group_size } => (-1, bits as i32, group_size as i32),
            Precision::Float { dtype } => (dtype_code(dtype)?, 0, 1),
        };
        gpu.launch(
            "embed_row",
            (blocks(self.cols, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(self.data),
                Arg::Ptr(self.scales),
                Arg::Ptr(self.biases),
                Arg::I32(row as i32),
                Arg::Ptr(out),
                Arg::I32(self.cols as i32),
                Arg::I32(copies as i32),
                Arg::I32(dtype),
                Arg::I32(bits),
                Arg::I32(gs),
            ],
        )
    }
}

pub fn dtype_code(d: DType) -> Result<i32> {
    Ok(match d {
        DType::BF16 => 0,
        DType::F16 => 1,
        DType::F32 => 2,
        other => bail!("{other} weights are not supported on CUDA"),
    })
}

pub struct HyperConnection {
    pub hc_norm: DevBuf,
    pub input_mix_weight_down: DevLinear,
    pub input_mix_weight_up: DevLinear,
    pub block_inject_weight: Option<DevLinear>,
}

pub struct GatedDeltaNet {
    pub in_proj_qkv: DevLinear,
    pub in_proj_z: DevLinear,
    pub in_proj_b: DevLinear,
    pub in_proj_a: DevLinear,
    pub conv1d: DevBuf,
    pub dt_bias: DevBuf,
    pub a_log: DevBuf,
    pub norm: DevBuf,
    pub out_proj: DevLinear,
}

pub struct Indexer {
    pub index_qk_proj: DevLinear,
    pub q_layernorm: DevBuf,
    pub k_layernorm: DevBuf,
}

pub struct Attention {
    pub q_proj: DevLinear,
    pub k_proj: DevLinear,
    pub v_proj: DevLinear,
    pub o_proj: DevLinear,
    pub q_norm: DevBuf,
    pub k_norm: DevBuf,
    pub indexer: Option<Indexer>,
}

pub struct Ple {
    pub ple_index: usize,
    pub key_proj: DevLinear,
    pub value_proj: DevLinear,
    pub norm_key: DevBuf,
    pub norm_query: DevBuf,
    pub norm_conv: DevBuf,
    pub conv1d: DevBuf,
}

pub struct Moe {
    pub gate: DevLinear,
    pub shared_gate_proj: DevLinear,
    pub shared_up_proj: DevLinear,
    pub shared_down_proj: DevLinear,
    pub shared_expert_gate: DevLinear,
    pub expert_slot: usize,
}

pub enum Mixer {
    Gdn(GatedDeltaNet),
    Attention(Attention),
}

pub struct Layer {
    pub ple: Option<Ple>,
    pub attn_hc: HyperConnection,
    pub mixer: Mixer,
    pub mlp_hc: HyperConnection,
    pub moe: Moe,
}

pub struct DeviceWeights {
    /// The whole of dense.bin.
    pub dense: DevBuf,
    pub embed_tokens: DevLinear,
    pub layers: Vec<Layer>,
    pub hyper_connection_mixer: HyperConnection,
    pub lm_head: DevLinear,
}

struct Binder<'a> {
    gpu: &'a Gpu,
    store: &'a Store,
    base: u64,
}

impl Binder<'_> {
    fn lin(&self, w: &cw::W) -> DevLinear {
        let v = self.store.view(w.0);
        let m = v.meta;
        DevLinear {
            precision: m.precision,
            rows: m.rows(),
            cols: m.cols(),
            data: self.base + m.data.offset,
            scales: m.scales.map_or(0, |s| self.base + s.offset),
            biases: m.biases.map_or(0, |s| self.base + s.offset),
        }
    }

    fn vec(&self, v: &[f32], what: &str) -> Result<DevBuf> {
        let b = self.gpu.alloc(v.len() * 4, what)?;
        self.gpu.htod(b.ptr, v)?;
        Ok(b)
    }

    fn hc(&self, h: &cw::HyperConnection) -> Result<HyperConnection> {
        Ok(HyperConnection {
            hc_norm: self.vec(&h.hc_norm, "hc_norm")?,
            input_mix_weight_down: self.lin(&h.input_mix_weight_down),
            input_mix_weight_up: self.lin(&h.input_mix_weight_up),
            block_inject_weight: h.block_inject_weight.as_ref().map(|w| self.lin(w)),
        })
    }

    fn attention(&self, a: &cw::Attention) -> Result<Attention> {
        Ok(Attention {
            q_proj: self.lin(&a.q_proj),
            k_proj: self.lin(&a.k_proj),
            v_proj: self.lin(&a.v_proj),
            o_proj: self.lin(&a.o_proj),
            q_norm: self.vec(&a.q_norm, "q_norm")?,
            k_norm: self.vec(&a.k_norm, "k_norm")?,
            indexer: match &a.indexer {
                Some(ix) => Some(Indexer {
                    index_qk_proj: self.lin(&ix.index_qk_proj),
                    q_layernorm: self.vec(&ix.q_layernorm, "q_layernorm")?,
                    k_layernorm: self.vec(&ix.k_layernorm, "k_layernorm")?,
                }),
                None => None,
            },
        })
    }

    fn moe(&self, m: &cw::Moe) -> Moe {
        Moe {
            gate: self.lin(&m.gate),
            shared_gate_proj: self.lin(&m.shared_gate_proj),
            shared_up_proj: self.lin(&m.shared_up_proj),
            shared_down_proj: self.lin(&m.shared_down_proj),
            shared_expert_gate: self.lin(&m.shared_expert_gate),
            expert_slot: m.expert_slot,
        }
    }
}

impl DeviceWeights {
    /// Uploads `dense.bin` and binds every tensor the CPU backend binds.
    pub fn upload(gpu: &Gpu, store: &Store, w: &cw::Weights) -> Result<DeviceWeights> {
        let bytes = store.dense_bytes();
        let dense = gpu.alloc(bytes.len(), "the dense weights (dense.bin)")?;
        // Upload in 256 MiB pieces so the host never needs a second copy.
        for (i, chunk) in bytes.chunks(256 << 20).enumerate() {
            gpu.htod(dense.at(i * (256 << 20)), chunk)?;
        }
        let b = Binder { gpu, store, base: dense.ptr };
        let mut layers = Vec::new();
        for l in &w.layers {
            let ple = match &l.ple {
                Some(p) => Some(Ple {
                    ple_index: p.ple_index,
                    key_proj: b.lin(&p.key_proj),
                    value_proj: b.lin(&p.value_proj),
                    norm_key: b.vec(&p.norm_key, "PLE norm_key")?,
                    norm_query: b.vec(&p.norm_query, "PLE norm_query")?,
                    norm_conv: b.vec(&p.norm_conv, "PLE norm_conv")?,
                    conv1d: b.vec(&p.conv1d, "PLE conv1d")?,
                }),
                None => None,
            };
            let mixer = match &l.mixer {
                cw::Mixer::Gdn(g) => Mixer::Gdn(GatedDeltaNet {
                    in_proj_qkv: b.lin(&g.in_proj_qkv),
                    in_proj_z: b.lin(&g.in_proj_z),
                    in_proj_b: b.lin(&g.in_proj_b),
                    in_proj_a: b.lin(&g.in_proj_a),
                    conv1d: b.vec(&g.conv1d, "GDN conv1d")?,
                    dt_bias: b.vec(&g.dt_bias, "dt_bias")?,
                    a_log: b.vec(&g.a_log, "A_log")?,
                    norm: b.vec(&g.norm, "GDN norm")?,
                    out_proj: b.lin(&g.out_proj),
                }),
                cw::Mixer::Attention(a) => Mixer::Attention(b.attention(a)?),
            };
            layers.push(Layer { ple, attn_hc: b.hc(&l.attn_hc)?, mixer, mlp_hc: b.hc(&l.mlp_hc)?, moe: b.moe(&l.moe) });
        }
        Ok(DeviceWeights {
            embed_tokens: b.lin(&w.embed_tokens),
            hyper_connection_mixer: b.hc(&w.hyper_connection_mixer)?,
            lm_head: b.lin(&w.lm_head),
            layers,
            dense,
        })
    }
}
