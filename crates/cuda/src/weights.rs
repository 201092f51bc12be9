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
use cherenkov_model::store::{ExpertLayout, Precision, RecordMatrix, Store};

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

/// The vector a matvec multiplies: x as stored, or a transform of it that the kernels apply where
/// they read (stage) x, so the elementwise launch that would precede the matvec is not needed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MatvecInput {
    /// x.
    Plain(u64),
    /// silu(x * s) (the hyper-connection read: silu(W_down n / hc); `scale_silu` in ops.cu).
    SiluScaled(u64, f32),
    /// silu(a) * b (the shared expert: silu(gate) * up; `silu_mul` in ops.cu).
    SiluMul(u64, u64),
    /// a * sigmoid(b) (the attention output gate; `mul_sigmoid` in ops.cu).
    MulSigmoid(u64, u64),
    /// x * (1 + w) (a zero-centred norm's weight, the norm's scale folded into the matvec:
    /// [`matvec_many_norm`]).
    OnePlus(u64, u64),
    /// x, whose producer also wrote its image as the tiled 4-bit kernel stages it (`MV_IN_DIGITS`
    /// in linear.cu: the GDN recurrence for its out_proj). That kernel, unsplit, copies the image;
    /// every other kernel and path reads x.
    Digits(u64, u64),
}

impl MatvecInput {
    /// The (first) input vector.
    pub fn x(self) -> u64 {
        match self {
            MatvecInput::Plain(x)
            | MatvecInput::SiluScaled(x, _)
            | MatvecInput::SiluMul(x, _)
            | MatvecInput::MulSigmoid(x, _)
            | MatvecInput::OnePlus(x, _)
            | MatvecInput::Digits(x, _) => x,
        }
    }

    /// The same input without a producer's image ([`MatvecInput::Digits`] as x).
    fn floats(self) -> MatvecInput {
        match self {
            MatvecInput::Digits(x, _) => MatvecInput::Plain(x),
            other => other,
        }
    }

    /// The kernels' transform arguments (x2, xs, op): `op` is `MV_IN_PLAIN` (0), `MV_IN_SILU_SCALED`
    /// (1), `MV_IN_SILU_MUL` (2), `MV_IN_MUL_SIGMOID` (3), `MV_IN_ONE_PLUS` (4) or `MV_IN_DIGITS` (5)
    /// of linear.cu.
    fn args(self) -> [Arg; 3] {
        match self {
            MatvecInput::Plain(_) => [Arg::Ptr(0), Arg::F32(0.0), Arg::I32(0)],
            MatvecInput::SiluScaled(_, s) => [Arg::Ptr(0), Arg::F32(s), Arg::I32(1)],
            MatvecInput::SiluMul(_, b) => [Arg::Ptr(b), Arg::F32(0.0), Arg::I32(2)],
            MatvecInput::MulSigmoid(_, b) => [Arg::Ptr(b), Arg::F32(0.0), Arg::I32(3)],
            MatvecInput::OnePlus(_, b) => [Arg::Ptr(b), Arg::F32(0.0), Arg::I32(4)],
            MatvecInput::Digits(_, img) => [Arg::Ptr(img), Arg::F32(0.0), Arg::I32(5)],
        }
    }
}

/// Where a matvec's rows go.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MatvecOutput {
    /// y (rows floats).
    Store(u64),
    /// Injected into the hyper-connection residual `x` (hc streams of rows floats), as `hc_inject`
    /// does: `x[s rows + j] += 2 sigmoid(inj[s] / hc) y[j]`. The `matvec_q*` kernels do it as they
    /// write each row; where the split or float kernels run instead, y goes to `scratch` first and
    /// `hc_inject` follows.
    Inject { x: u64, inj: u64, hc: usize, scratch: u64 },
}

/// Where [`DevLinear::matvec_rows`] puts each row's outputs (strides in bytes between rows).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowsOutput {
    /// Row r's `rows` floats at `y + r stride`.
    Store { y: u64, stride: usize },
    /// Row r injected into its residual `x + r x_stride` with the logits `inj + r inj_stride`, as
    /// [`MatvecOutput::Inject`] injects one row.
    Inject { x: u64, x_stride: usize, inj: u64, inj_stride: usize, hc: usize },
}

/// `x[s h + j] += 2 sigmoid(inj[s] / hc) out[j]` for the `hc` streams of `h` (`hc_inject` in ops.cu).
pub fn hc_inject(gpu: &Gpu, x: u64, inj: u64, out: u64, hc: usize, h: usize) -> Result<()> {
    gpu.launch(
        "hc_inject",
        (blocks(hc * h, 256), 1, 1),
        256,
        0,
        &[Arg::Ptr(x), Arg::Ptr(inj), Arg::Ptr(out), Arg::I32(hc as i32), Arg::I32(h as i32)],
    )
}

impl DevLinear {
    /// Whether a producer's staged image of this matrix's input is worth writing
    /// ([`MatvecInput::Digits`]): only 4-bit rows are staged as digits (linear.cu's `MV_DP4A`).
    pub fn stages_digits(&self) -> bool {
        matches!(self.precision, Precision::Affine { bits: 4, .. })
    }

    /// Whether [`DevLinear::matvec_rows`] takes `nx` rows in one launch here (else one launch a
    /// row): 4-bit rows of the tiled format, 2 or 4 rows whose staged digits fit.
    pub fn rows_in_one(&self, nx: usize) -> bool {
        matches!(self.precision, Precision::Affine { bits: 4, .. })
            && matches!(nx, 2 | 4)
            && self.tiled_shmem().is_some()
            && nx * rows_staging_bytes(self.cols) <= MAX_STAGED_X
    }

    /// `nx` input rows through W: row r of x at `x + r xstride` (bytes), its `rows` outputs where
    /// `out` puts them ([`RowsOutput`]). Where [`DevLinear::rows_in_one`], one launch whose weights
    /// serve every row (`matvec_q4_x2`, `matvec_q4_x4` in linear.cu; each row's result is the
    /// unsplit tiled `matvec_q4`'s with the same lanes a tile, bit for bit). Elsewhere stored rows
    /// take [`DevLinear::matvec`] once a row, and injected ones are refused (they would need a
    /// scratch row). Built for a verifying forward's rows in one pass; nothing in the forward
    /// calls it yet. (The MTP stem's four `fc_hidden` streams, 2560 x 2560, made a draft 0.012 ms
    /// slower this way than as four `matvec_q4` launches: `benchmark/notes-cuda.md`, "Session
    /// 48".)
    pub fn matvec_rows(&self, gpu: &Gpu, x: u64, xstride: usize, out: RowsOutput, nx: usize) -> Result<()> {
        let (y, ystride, xres, resstride, inj, injstride, hc) = match out {
            RowsOutput::Store { y, stride } => (y, stride, 0, 0, 0, 0, 0),
            RowsOutput::Inject { x, x_stride, inj, inj_stride, hc } => (0, 0, x, x_stride, inj, inj_stride, hc),
        };
        if !self.rows_in_one(nx) {
            if xres != 0 {
                bail!(
                    "matvec_rows: {nx} injected rows of a {}x{} matrix that takes them only one at a time",
                    self.rows,
                    self.cols
                );
            }
            for r in 0..nx {
                self.matvec(gpu, x + (r * xstride) as u64, y + (r * ystride) as u64)?;
            }
            return Ok(());
        }
        if !(xstride.is_multiple_of(16) && [ystride, resstride, injstride].iter().all(|s| s.is_multiple_of(4))) {
            bail!(
                "matvec_rows: row strides of {xstride}, {ystride}, {resstride} and {injstride} bytes (x rows must stay 16-byte aligned)"
            );
        }
        let Precision::Affine { group_size, .. } = self.precision else { unreachable!("checked: 4-bit") };
        let (plan, shmem) = self.rows_plan(gpu, nx);
        gpu.launch(
            &format!("matvec_q4_x{nx}"),
            (plan.blocks as u32, 1, 1),
            plan.threads as u32,
            shmem as u32,
            &[
                Arg::Ptr(self.data),
                Arg::Ptr(self.scales),
                Arg::Ptr(self.biases),
                Arg::Ptr(x),
                Arg::Ptr(y),
                Arg::I32(self.rows as i32),
                Arg::I32(self.cols as i32),
                Arg::I32(group_size as i32),
                Arg::I32(plan.lanes as i32),
                Arg::U64((xstride / 4) as u64),
                Arg::U64((ystride / 4) as u64),
                Arg::Ptr(xres),
                Arg::Ptr(inj),
                Arg::I32(hc as i32),
                Arg::U64((resstride / 4) as u64),
                Arg::U64((injstride / 4) as u64),
            ],
        )
    }

    /// The launch shape of [`DevLinear::matvec_rows`] for `nx` rows in one launch, and its shared
    /// memory: the tiled plan for 2 blocks a multiprocessor and `nx` staged rows.
    pub fn rows_plan(&self, gpu: &Gpu, nx: usize) -> (TilePlan, usize) {
        let shmem = nx * rows_staging_bytes(self.cols);
        (tile_plan(gpu, self.rows.div_ceil(MV_R), self.cols / chunk_codes(4), 1, 2, shmem), shmem)
    }

    /// y = W x (x: cols floats, y: rows floats).
    pub fn matvec(&self, gpu: &Gpu, x: u64, y: u64) -> Result<()> {
        self.matvec_in(gpu, MatvecInput::Plain(x), y)
    }

    /// W in(x), into `out` ([`MatvecOutput`]).
    pub fn matvec_to(&self, gpu: &Gpu, input: MatvecInput, out: MatvecOutput) -> Result<()> {
        match out {
            MatvecOutput::Store(y) => self.matvec_in(gpu, input, y),
            MatvecOutput::Inject { x, inj, hc, scratch } => {
                if self.launch_matvec(gpu, input, scratch, Some((x, inj, hc)))? {
                    return Ok(());
                }
                hc_inject(gpu, x, inj, scratch, hc, self.rows)
            }
        }
    }

    /// y = W in(x) for an input transform `in` ([`MatvecInput`]; its vectors are cols floats), applied
    /// by every kernel as it reads x: the tiled kernels while they stage x (the column slices of a
    /// split matvec stage their slice) and sum it per unit, the 2-, 4- and 8-bit kernels with rows
    /// per block and `matvec_float` while they stage x, and the 3-, 5- and 6-bit kernel by staging
    /// in(x) (padded, one float per 32) with rows per block instead of reading x from global
    /// memory. Only where that padded copy would pass the staging limit (3, 5 and 6 bits, over
    /// about 39700 inputs) is the transform an elementwise launch, in place (the input vector is then
    /// overwritten with in(x)), before the plain matvec.
    ///
    /// 2-, 4- and 8-bit weights whose rows are whole 16-byte chunks (every shape of the model) use
    /// the tiled kernel of `linear.cu`: tiles of 4 rows, `L` lanes per tile (`rpb` = `MV_TILED | L`,
    /// see [`tile_plan`]), x staged once per block and the blocks looping over the tiles. When that
    /// gives fewer blocks than multiprocessors (few rows, many columns) the columns are split across
    /// blocks instead ([`split_plan`], through `matvec_many` with one part). Other precisions
    /// and shapes keep the kernels with rows per block (`rpb` = rows) or one warp per row.
    pub fn matvec_in(&self, gpu: &Gpu, input: MatvecInput, y: u64) -> Result<()> {
        self.launch_matvec(gpu, input, y, None).map(|_| ())
    }

    /// [`DevLinear::matvec_in`], with `inject` = (x, inj, hc) passed to the `matvec_q*` kernels
    /// ([`MatvecOutput::Inject`]); whether the rows were injected (else they are in `y`).
    fn launch_matvec(&self, gpu: &Gpu, input: MatvecInput, y: u64, inject: Option<(u64, u64, usize)>) -> Result<bool> {
        if self.cols * 4 > MAX_STAGED_X {
            bail!("a linear of {} inputs is wider than the kernels' staging limit", self.cols);
        }
        // A producer's image (MatvecInput::Digits) goes only to the unsplit tiled kernel; every other
        // path takes x.
        let (tiled_input, input) = (input, input.floats());
        let x = input.x();
        let (xres, inj, hc) = inject.unwrap_or((0, 0, 0));
        let args_of = |input: MatvecInput, gs: usize, rpb: usize| {
            let [x2, xs, op] = input.args();
            [
                Arg::Ptr(self.data),
                Arg::Ptr(self.scales),
                Arg::Ptr(self.biases),
                Arg::Ptr(x),
                Arg::Ptr(y),
                Arg::I32(self.rows as i32),
                Arg::I32(self.cols as i32),
                Arg::I32(gs as i32),
                Arg::I32(rpb as i32),
                x2,
                xs,
                op,
                Arg::Ptr(xres),
                Arg::Ptr(inj),
                Arg::I32(hc as i32),
            ]
        };
        let args = |gs: usize, rpb: usize| args_of(input, gs, rpb);
        let injected = inject.is_some();
        let rpb = rows_per_block(self.rows, BLOCKS_WANTED);
        let staged = (self.cols * 4) as u32;
        match self.precision {
            Precision::Affine { bits, group_size } => {
                let name = format!("matvec_q{bits}");
                if let Some(shmem) = self.tiled_shmem() {
                    let min_blocks = if bits == 2 { 2 } else { 3 };
                    let plan =
                        tile_plan(gpu, self.rows.div_ceil(MV_R), self.cols / chunk_codes(bits), 1, min_blocks, shmem);
                    if plan.blocks < sms(gpu) {
                        // Too few blocks to fill the GPU: split the columns (one-part matvec_many).
                        let min_blocks = many_kernel(&[bits]).1;
                        let split = split_plan(gpu, self.rows, self.cols, bits, group_size, min_blocks);
                        if split.slices > 1 {
                            return launch_many(gpu, input, &[(self, y)], &[split], None, None, 0, false, None)
                                .map(|_| false);
                        }
                    }
                    let a = args_of(tiled_input, group_size, MV_TILED | plan.lanes);
                    gpu.launch(&name, (plan.blocks as u32, 1, 1), plan.threads as u32, shmem as u32, &a)?;
                    return Ok(injected);
                }
                if matches!(bits, 2 | 4 | 8) {
                    gpu.launch(&name, (blocks(self.rows, rpb), 1, 1), 256, staged, &args(group_size, rpb))?;
                } else if matches!(input, MatvecInput::Plain(_)) {
                    gpu.launch(&name, (blocks(self.rows * 32, 128), 1, 1), 128, 0, &args(group_size, rpb))?;
                } else {
                    // in(x) staged with one float of padding per 32 (matvec_affine_in).
                    let padded = (self.cols + self.cols / 32) * 4;
                    if padded > MAX_STAGED_X {
                        return self.matvec_unfused(gpu, input, y).map(|()| false);
                    }
                    gpu.launch(&name, (blocks(self.rows, rpb), 1, 1), 256, padded as u32, &args(group_size, rpb))?;
                }
                Ok(injected)
            }
            Precision::Float { dtype } => {
                let [x2, xs, op] = input.args();
                gpu.launch(
                    "matvec_float",
                    (blocks(self.rows, rpb), 1, 1),
                    256,
                    staged,
                    &[
                        Arg::Ptr(self.data),
                        Arg::Ptr(x),
                        Arg::Ptr(y),
                        Arg::I32(self.rows as i32),
                        Arg::I32(self.cols as i32),
                        Arg::I32(dtype_code(dtype)?),
                        Arg::I32(rpb as i32),
                        x2,
                        xs,
                        op,
                    ],
                )
                .map(|()| false)
            }
        }
    }

    /// The transform as its elementwise kernel (in place into the input vector), then the plain
    /// matvec: for the shapes whose kernels cannot stage in(x).
    fn matvec_unfused(&self, gpu: &Gpu, input: MatvecInput, y: u64) -> Result<()> {
        let n = self.cols;
        match input {
            MatvecInput::Plain(_) | MatvecInput::Digits(..) => {}
            MatvecInput::SiluScaled(x, s) => gpu.launch(
                "scale_silu",
                (blocks(n, 256), 1, 1),
                256,
                0,
                &[Arg::Ptr(x), Arg::I32(n as i32), Arg::F32(s)],
            )?,
            MatvecInput::SiluMul(a, b) => {
                gpu.launch("silu_mul", (blocks(n, 256), 1, 1), 256, 0, &[Arg::Ptr(a), Arg::Ptr(b), Arg::I32(n as i32)])?
            }
            MatvecInput::MulSigmoid(a, b) => gpu.launch(
                "mul_sigmoid",
                (blocks(n, 256), 1, 1),
                256,
                0,
                &[Arg::Ptr(a), Arg::Ptr(b), Arg::I32(n as i32)],
            )?,
            MatvecInput::OnePlus(..) => {
                bail!("x (1 + w) has no elementwise kernel: a matvec of {} inputs cannot apply it", n)
            }
        }
        self.matvec(gpu, input.x(), y)
    }

    /// The embedding of the token at `step[0]` (device memory: the step inputs), written `copies` times
    /// into `out`.
    pub fn embed(&self, gpu: &Gpu, step: u64, out: u64, copies: usize) -> Result<()> {
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
                Arg::Ptr(step),
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

impl DevLinear {
    /// Shared memory of the tiled kernels for this matrix (x and its unit sums), if they apply: 2-,
    /// 4- and 8-bit rows of whole 16-byte chunks, 16-byte aligned, groups that are whole x-sum units
    /// (32 codes, 16 at 8 bits), x and its sums within the staging limit.
    pub fn tiled_shmem(&self) -> Option<usize> {
        match self.precision {
            Precision::Affine { bits, group_size }
                if self.data.is_multiple_of(16) && offsets_fit_u32(self.rows, self.cols, bits, group_size) =>
            {
                tiled_shmem(bits, group_size, self.cols)
            }
            _ => None,
        }
    }
}

/// Must match `MV_TILED`, `MV_R` and `MV_PARTS` in linear.cu.
pub const MV_TILED: usize = 0x10000;
const MV_R: usize = 4;
const MV_PARTS: usize = 4;
/// Partial sums per part of the split kernel (`MV_PART_FLOATS`).
const MV_PART_FLOATS: usize = 16384;
/// Floats before the partial sums in the split kernel's scratch (`MV_SCRATCH_HEAD`).
const MV_SCRATCH_HEAD: usize = 64;
/// Threads per block of the tiled kernels (at most).
const MV_THREADS: usize = 256;
/// Shared memory a multiprocessor gives its blocks (Hopper: 228 KiB, 1 KiB of it reserved per
/// block), used to cap grids at one wave.
const SM_SHARED: usize = 228 << 10;
/// Fewest chunks per column slice of a split matvec.
const MIN_SLICE: usize = 16;
/// Most column slices of a split matvec.
const MAX_SLICES: usize = 32;

/// Whether the experts' launches are spread over the multiprocessors (the default;
/// `CHERENKOV_NO_SPREAD_EXPERTS=1` leaves them as planned). The block scheduler fills some
/// multiprocessors to their limit and leaves others with one block: the experts' down launch's 220
/// blocks sat 3 to a multiprocessor on about 24 of them and 1 on about 68 (session 21's
/// timelines), and a multiprocessor's third block slows its other two. Padding their shared memory
/// to 2 a multiprocessor took 1.0 us off the down launch and 0.4 off the gate/up's. The same for
/// `matvec_many` (the GDN in_proj's 258 blocks in a grid of 640) made it 5 us slower: blocks that
/// do no work and the previous kernel's blocks took the slots, and a few working blocks started
/// only when others had ended.
pub fn spread_experts() -> bool {
    use std::sync::OnceLock;
    static SPREAD: OnceLock<bool> = OnceLock::new();
    *SPREAD.get_or_init(|| std::env::var("CHERENKOV_NO_SPREAD_EXPERTS").map_or(true, |v| v != "1"))
}

/// The dynamic shared memory to ask for a launch of `working` blocks, each using `shmem` bytes, of
/// a kernel whose `__launch_bounds__` promise `min_blocks` to a multiprocessor, so that no more than
/// `ceil(working / sms)` of them fit on one (the padding is never read).
fn spread_shmem(sms: usize, shmem: usize, working: usize, min_blocks: usize) -> usize {
    spread_shmem_for(sms, shmem, working, (SM_SHARED / (shmem + 2048)).clamp(1, min_blocks))
}

/// [`spread_shmem`] without the switch: each block takes its bytes and 1 KiB reserved (2 KiB
/// counted, for the kernels' static arrays), so `cap` blocks fit and `cap + 1` do not.
fn spread_shmem_for(sms: usize, shmem: usize, working: usize, per_sm: usize) -> usize {
    let cap = working.div_ceil(sms.max(1)).max(1);
    if cap >= per_sm {
        return shmem;
    }
    let padded = SM_SHARED / (cap + 1) + 1024;
    if padded > MAX_STAGED_X || shmem >= padded { shmem } else { padded }
}

/// A measurement knob for the `matvec_many` launches without a folded norm (`CHERENKOV_MANY_SPREAD=b`,
/// a number of blocks a multiprocessor, for example 1.5): each launch plans one wave of `b` blocks a
/// multiprocessor instead of as many as fit, and pads its shared memory so that no more than
/// `ceil(b)` fit on one. In session 27's block records the GDN in_proj's 258 working blocks sat 1 or
/// 3 to a multiprocessor, those on crowded ones ending 2-3 us later; session 21's padding to 2
/// with the same 258 blocks left no free slot and lost to a second wave (`benchmark/notes-cuda.md`).
/// Session 28 ran 1.5, 1.75 and 2: each was slower (the in_proj's last block 4-5 us later).
/// Unset (the default): the plans as before. Read once per process.
fn many_spread() -> Option<f64> {
    use std::sync::OnceLock;
    static SPREAD: OnceLock<Option<f64>> = OnceLock::new();
    *SPREAD.get_or_init(|| {
        std::env::var("CHERENKOV_MANY_SPREAD").ok().and_then(|v| v.parse::<f64>().ok()).filter(|b| *b > 0.0)
    })
}

/// Blocks in one wave of a `matvec_many` part: `per_sm` resident blocks a multiprocessor (or
/// `spread`'s fewer), the part's `share` of them.
fn many_wave(sms: usize, per_sm: usize, share: f64, spread: Option<f64>) -> usize {
    let per_sm = spread.map_or(per_sm as f64, |b| b.min(per_sm as f64));
    ((sms as f64 * per_sm * share) as usize).max(1)
}

/// Whether `matvec_many` launches take their 4-bit parts' weights ahead where that applies
/// ([`ahead_bytes`]; `CHERENKOV_MANY_AHEAD=0` turns it off, `1` on). Read once per process.
pub fn many_ahead() -> bool {
    use std::sync::OnceLock;
    static AHEAD: OnceLock<bool> = OnceLock::new();
    *AHEAD.get_or_init(|| std::env::var("CHERENKOV_MANY_AHEAD").is_ok_and(|v| v == "1"))
}

/// The dynamic shared memory a `matvec_many_ahead` block needs for a part whose weights it takes
/// ahead (`mv_ahead_q4` in linear.cu: each block's rows copied into shared memory by the tensor
/// memory accelerator before the block waits for the previous kernel), or `None` where that does
/// not apply: the part must be 4-bit with whole rows (one column slice), tiles of at most 32 lanes
/// covered in one pass by its `blocks` blocks of `threads`, groups a row a multiple of 8 and its
/// arrays 16-byte aligned (so that every bulk copy is), and the bytes must fit [`MAX_STAGED_X`].
/// x's staging, then the block's rows, their scales and biases, then an mbarrier a warp.
pub fn ahead_bytes(lin: &DevLinear, plan: &SplitPlan, threads: usize, blocks: usize) -> Option<usize> {
    let Precision::Affine { bits: 4, group_size } = lin.precision else { return None };
    let lanes = plan.plan.lanes;
    let (chunks, gpr) = (lin.cols / chunk_codes(4), lin.cols / group_size.max(1));
    let tiles = lin.rows.div_ceil(MV_R);
    let rows_per_block = threads / lanes * MV_R;
    let fits = plan.slices == 1
        && lanes <= 32
        && blocks * (threads / lanes) >= tiles
        && gpr.is_multiple_of(8)
        && [lin.data, lin.scales, lin.biases].iter().all(|p| p.is_multiple_of(16));
    let x = (lin.cols * 4 + lin.cols / 32 * 4).next_multiple_of(128);
    let bytes = x + rows_per_block * (chunks * 16 + gpr * 4) + threads / 32 * 8;
    (fits && bytes <= MAX_STAGED_X).then_some(bytes)
}

/// Codes per 16-byte chunk.
fn chunk_codes(bits: u32) -> usize {
    128 / bits as usize
}

/// Shared memory of the tiled kernels for `cols` inputs of a `bits`/`gs` format, if they apply
/// (the data must also be 16-byte aligned: the caller checks).
pub fn tiled_shmem(bits: u32, gs: usize, cols: usize) -> Option<usize> {
    if !matches!(bits, 2 | 4 | 8) {
        return None;
    }
    let cpc = chunk_codes(bits);
    let unit = cpc.min(32);
    // x as floats and its unit sums; 4-bit rows staged as digits (linear.cu's MV_DP4A) take less,
    // 3.75 bytes per input.
    let shmem = cols * 4 + cols / unit * 4;
    (cols.is_multiple_of(cpc)
        && gs.is_power_of_two()
        && gs.is_multiple_of(unit)
        && cols.is_multiple_of(gs)
        && shmem <= MAX_STAGED_X)
        .then_some(shmem)
}

/// Bytes of shared memory one input row of `cols` takes staged as digits (linear.cu's
/// `mvd_rows_float4s`: 7 uint4 of digits and a float2 a chunk of 32, the float2s padded to whole
/// uint4): 3.75 bytes an input.
pub fn rows_staging_bytes(cols: usize) -> usize {
    let chunks = cols / 32;
    16 * (chunks * 7 + chunks.div_ceil(2))
}

/// Whether a verifying pass's hyper-connection reads launch each row's blocks as a step would
/// (`CHERENKOV_ROWS_READ_FULL=1`, a measurement) instead of dividing one row's blocks among the
/// rows.
fn rows_read_full() -> bool {
    use std::sync::OnceLock;
    static FULL: OnceLock<bool> = OnceLock::new();
    *FULL.get_or_init(|| std::env::var_os("CHERENKOV_ROWS_READ_FULL").is_some_and(|v| v != "0"))
}

/// Whether a verifying pass's expert launches give each row a step's blocks
/// (`CHERENKOV_ROWS_EXPERTS_FULL=1`, a measurement) instead of dividing one row's among the rows.
fn rows_experts_full() -> bool {
    use std::sync::OnceLock;
    static FULL: OnceLock<bool> = OnceLock::new();
    *FULL.get_or_init(|| std::env::var_os("CHERENKOV_ROWS_EXPERTS_FULL").is_some_and(|v| v != "0"))
}

/// Whether the tiled core's 32-bit offsets (`mv_load` in linear.cu) reach every 16-byte chunk and
/// every group of a `rows` x `cols` matrix of a `bits`/`gs` format (both counts below 2^32).
pub fn offsets_fit_u32(rows: usize, cols: usize, bits: u32, gs: usize) -> bool {
    let most = (cols / chunk_codes(bits)).max(cols / gs.max(1));
    rows.checked_mul(most).is_some_and(|n| n <= u32::MAX as usize)
}

/// Multiprocessors of the GPU.
pub fn sms(gpu: &Gpu) -> usize {
    use std::sync::OnceLock;
    static SMS: OnceLock<usize> = OnceLock::new();
    *SMS.get_or_init(|| {
        gpu.ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |n| n.max(1) as usize)
    })
}

fn threads_per_sm() -> usize {
    use std::sync::OnceLock;
    static THREADS_PER_SM: OnceLock<usize> = OnceLock::new();
    *THREADS_PER_SM.get_or_init(|| env_count("CHERENKOV_MATVEC_THREADS_PER_SM").unwrap_or(512))
}

/// A positive count from the environment variable `name`, if it holds one.
fn env_count(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok()).filter(|&v| v > 0)
}

/// The threads-per-multiprocessor target of the expert kernels' plan (default
/// [`EXPERT_THREADS_PER_SM`]; `CHERENKOV_EXPERT_THREADS_PER_SM` sets another, a measurement knob
/// read once).
fn expert_threads_per_sm() -> usize {
    use std::sync::OnceLock;
    static PER_SM: OnceLock<usize> = OnceLock::new();
    *PER_SM.get_or_init(|| env_count("CHERENKOV_EXPERT_THREADS_PER_SM").unwrap_or(EXPERT_THREADS_PER_SM))
}

/// Half the dense matvecs' target: ten experts' gate/up then take 16 lanes and 20 blocks each,
/// their down projections 8 lanes and 20 blocks (32 and 16 lanes, 40 blocks at 512). With 4-bit
/// rows by dp4a, a resident step at 16 layers on the H200 ran at 499.0-505.8 tok/s against
/// 489.9-495.9 with 512 (three alternating rounds, `benchmark/notes-cuda.md`, "Session 13").
const EXPERT_THREADS_PER_SM: usize = 256;

/// Launch shape of the tiled core for one matrix: `lanes` per tile (`rpb` = `MV_TILED | lanes`),
/// `threads` per block, `blocks` per copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TilePlan {
    pub lanes: usize,
    pub threads: usize,
    pub blocks: usize,
}

/// The plan for `copies` matrices (grid y, or column slices) of `tiles` tiles of `chunks` chunks,
/// launched together. `L` is the smallest power of two (8 to 256, at most the chunks rounded up)
/// that gives the launch about `CHERENKOV_MATVEC_THREADS_PER_SM` (default 512) threads per
/// multiprocessor; the blocks are capped at what the multiprocessors hold at once (`min_blocks`:
/// the kernel's `__launch_bounds__` minimum), so large matrices stage x a few times per
/// multiprocessor instead of once per few rows. Where that leaves some blocks a second pass over
/// few steps, `L` is halved while the estimated passes x steps drops (the GDN and attention input
/// projections: one pass of 5 steps instead of two of 3).
pub fn tile_plan(gpu: &Gpu, tiles: usize, chunks: usize, copies: usize, min_blocks: usize, shmem: usize) -> TilePlan {
    plan_tiles(sms(gpu), threads_per_sm(), tiles, chunks, copies, min_blocks, shmem, 1.0)
}

/// [`tile_plan`] for a GPU of `sms` multiprocessors and the `per_sm` threads target, of which the
/// launch gets the fraction `share` (a part of a `matvec_many` launch planned jointly: see
/// [`joint_many`]).
#[allow(clippy::too_many_arguments)]
fn plan_tiles(
    sms: usize,
    per_sm: usize,
    tiles: usize,
    chunks: usize,
    copies: usize,
    min_blocks: usize,
    shmem: usize,
    share: f64,
) -> TilePlan {
    let l_max = chunks.next_power_of_two().min(MV_THREADS);
    let mut lanes = l_max.min(8);
    let target = ((sms * per_sm) as f64 * share) as usize;
    while lanes < l_max && tiles * copies * lanes < target {
        lanes *= 2;
    }
    let per_sm_blocks = (SM_SHARED / (shmem + 2048)).clamp(1, min_blocks);
    let wave = ((sms * per_sm_blocks) as f64 * share) as usize;
    let cap = wave.div_ceil(copies.max(1)).max(1);
    let shape = |lanes: usize| {
        let threads = (tiles * lanes).next_power_of_two().clamp(32, MV_THREADS);
        (threads, tiles.div_ceil(threads / lanes))
    };
    // Where the tiles need more blocks than one wave holds, some blocks make a second pass; fewer
    // lanes per tile put more tiles in each block. Keep halving while that lowers the estimated
    // time: passes x (steps per tile + about 2 steps of staging x).
    let cost = |lanes: usize| {
        let (_, needed) = shape(lanes);
        needed.div_ceil(cap) * (chunks.div_ceil(lanes) + 2)
    };
    while lanes > 8 && shape(lanes).1 > cap && cost(lanes / 2) < cost(lanes) {
        lanes /= 2;
    }
    let (threads, needed) = shape(lanes);
    let blocks = needed.min(cap).max(1);
    TilePlan { lanes, threads, blocks }
}

/// A part of a split launch: `slices` column slices, each run with `plan`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitPlan {
    pub slices: usize,
    pub plan: TilePlan,
    pub shmem: usize,
    /// The fraction of one wave this part's blocks may take (1: the whole GPU; [`joint_many`]).
    pub share: f64,
}

/// Whether the parts of a `matvec_many` launch are planned jointly (the default;
/// `CHERENKOV_MANY_JOINT=0` plans each part for the whole GPU, as before session 11): each part
/// gets the share of one wave that its bits are of the launch's, so the parts together fill one
/// wave. The GDN input projection planned part by part took 320 + 384 blocks (qkv, z) against the
/// 396 that stay resident, 18.6 us per launch; jointly 160 + 96 blocks of 16 lanes, 15.6 us
/// (`tests/matvec_probe.rs`, `benchmark/results/matvec-probe-2026-11-30.txt`).
pub fn joint_many() -> bool {
    use std::sync::OnceLock;
    static JOINT: OnceLock<bool> = OnceLock::new();
    *JOINT.get_or_init(|| std::env::var("CHERENKOV_MANY_JOINT").map_or(true, |v| v != "0"))
}

/// Column slices for a matrix of `rows` x `cols` (tiled format): the columns are halved while the
/// launch has fewer blocks than multiprocessors and the halves stay whole groups of at least
/// `MIN_SLICE` chunks (each block then stages only its slice of x and reads fewer chunks per row).
pub fn split_plan(gpu: &Gpu, rows: usize, cols: usize, bits: u32, gs: usize, min_blocks: usize) -> SplitPlan {
    split_plan_from(gpu, rows, cols, bits, gs, min_blocks, 1, 1.0).expect("one slice is always a plan")
}

/// [`split_plan`] with at least `min_slices` slices (a power of two); `None` where the columns do
/// not split that far.
fn split_plan_from(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    bits: u32,
    gs: usize,
    min_blocks: usize,
    min_slices: usize,
    share: f64,
) -> Option<SplitPlan> {
    let cpc = chunk_codes(bits);
    let (tiles, chunks) = (rows.div_ceil(MV_R), cols / cpc);
    let shmem_of = |k: usize| tiled_shmem(bits, gs, cols / k).unwrap_or(MAX_STAGED_X);
    let splits = |k: usize| {
        k == 1
            || (k <= MAX_SLICES
                && chunks.is_multiple_of(k)
                && chunks / k >= MIN_SLICE
                && (chunks / k * cpc).is_multiple_of(gs)
                && rows * k <= MV_PART_FLOATS)
    };
    let mut k = min_slices.max(1);
    if !k.is_power_of_two() || !splits(k) {
        return None;
    }
    let plan_k =
        |k: usize| plan_tiles(sms(gpu), threads_per_sm(), tiles, chunks / k, k, min_blocks, shmem_of(k), share);
    let mut plan = plan_k(k);
    while ((plan.blocks * k) as f64) < sms(gpu) as f64 * share && splits(k * 2) {
        k *= 2;
        plan = plan_k(k);
    }
    Some(SplitPlan { slices: k, plan, shmem: shmem_of(k), share })
}

/// The `matvec_many` kernel for parts of these widths and the blocks of 256 threads per
/// multiprocessor its `__launch_bounds__` promise: `matvec_many_48` (3) when every part is 4- or
/// 8-bit, else `matvec_many` (2: the 2-bit instantiation's registers). A folded norm always takes
/// `matvec_many`.
fn many_kernel(bits: &[u32]) -> (&'static str, usize) {
    if bits.iter().all(|&b| b == 4 || b == 8) { ("matvec_many_48", 3) } else { ("matvec_many", 2) }
}

/// The affine widths of `parts` (0 for floating weights, which no tiled kernel takes).
fn part_bits(parts: &[(&DevLinear, u64)]) -> Vec<u32> {
    parts
        .iter()
        .map(|(l, _)| match l.precision {
            Precision::Affine { bits, .. } => bits,
            Precision::Float { .. } => 0,
        })
        .collect()
}

/// A `matvec_many` launch over a verifying pass's two input rows in each block
/// (`matvec_many_x2`): row 1 of x and of every output `stride` bytes past row 0's, and where the
/// conv is folded, the state after row 0 written to `conv_mid`.
#[derive(Clone, Copy, Debug)]
struct ManyPair {
    stride: usize,
    conv_mid: u64,
}

/// One launch of `matvec_many` for up to `MV_PARTS` matrices of one input (`cols` inputs), each
/// in a tiled format of its own, with their split plans (with `pair`, over two input rows).
#[allow(clippy::too_many_arguments)]
fn launch_many(
    gpu: &Gpu,
    input: MatvecInput,
    parts: &[(&DevLinear, u64)],
    plans: &[SplitPlan],
    norm: Option<FoldedNorm>,
    conv: Option<FoldedConv>,
    defer_parts: u32,
    ahead: bool,
    pair: Option<ManyPair>,
) -> Result<u32> {
    debug_assert!(!parts.is_empty() && parts.len() <= MV_PARTS && parts.len() == plans.len());
    debug_assert!(conv.is_none() || plans[0].slices == 1);
    let cols = parts[0].0.cols;
    // One block size for the launch: blocks per slice follow from it.
    let threads = plans.iter().map(|p| p.plan.threads).max().unwrap_or(32);
    let (kernel, min_blocks) = if norm.is_some() { ("matvec_many", 2) } else { many_kernel(&part_bits(parts)) };
    let sms = sms(gpu);
    let spread = if norm.is_none() { many_spread() } else { None };
    let [x2, xs, op] = input.args();
    let mut args = vec![Arg::Ptr(input.x()), x2, xs, op, Arg::I32(cols as i32), Arg::Ptr(gpu.split_scratch_ptr())];
    let (mut grid_x, mut shmem) = (1usize, 0usize);
    // The parts that take their weights ahead (bit p: part p) and the shared memory they need.
    let ahead_ok = ahead && norm.is_none() && kernel == "matvec_many_48" && gpu.info.compute_capability.0 >= 9;
    let (mut ahead_parts, mut ahead_shmem, mut flat_grid) = (0u32, 0usize, 0usize);
    let halve = gpu.rows().0 > 1 && norm.is_some() && pair.is_none() && !rows_read_full();
    for i in 0..MV_PARTS {
        match parts.get(i) {
            Some(&(lin, y)) => {
                let Precision::Affine { bits, group_size } = lin.precision else {
                    bail!("matvec_many takes affine matrices only");
                };
                if lin.cols != cols {
                    bail!("matvec_many: parts of {} and {} inputs", cols, lin.cols);
                }
                let sp = plans[i];
                let tiles = lin.rows.div_ceil(MV_R);
                let per_sm_blocks = (SM_SHARED / (sp.shmem + 2048)).clamp(1, min_blocks);
                let wave = many_wave(sms, per_sm_blocks, sp.share, spread);
                let nb = tiles.div_ceil(threads / sp.plan.lanes).min(wave.div_ceil(sp.slices)).max(1);
                // A verifying pass's rows through the folded norm's launch (`matvec_many_rows`):
                // each row's blocks divided among the rows, the lanes a tile kept (a block takes its
                // tiles in several passes), so the rows' grid holds what one row's does and each
                // row's sums stay a step's.
                let nb = if halve { nb.div_ceil(gpu.rows().0 as usize) } else { nb };
                grid_x = grid_x.max(nb * sp.slices);
                flat_grid += nb * sp.slices;
                shmem = shmem.max(sp.shmem);
                if let Some(bytes) = ahead_ok.then(|| ahead_bytes(lin, &sp, threads, nb)).flatten() {
                    ahead_parts |= 1 << i;
                    ahead_shmem = ahead_shmem.max(bytes);
                }
                args.extend([
                    Arg::Ptr(lin.data),
                    Arg::Ptr(lin.scales),
                    Arg::Ptr(lin.biases),
                    Arg::Ptr(y),
                    Arg::I32(lin.rows as i32),
                    Arg::I32(sp.plan.lanes as i32),
                    Arg::I32(nb as i32),
                    Arg::I32(sp.slices as i32),
                    Arg::I32(bits as i32),
                    Arg::I32(group_size as i32),
                ]);
            }
            None => args.extend([
                Arg::Ptr(0),
                Arg::Ptr(0),
                Arg::Ptr(0),
                Arg::Ptr(0),
                Arg::I32(0),
                Arg::I32(1),
                Arg::I32(0),
                Arg::I32(1),
                Arg::I32(4),
                Arg::I32(64),
            ]),
        }
    }
    match norm {
        Some(n) => args.extend([Arg::I32(n.group as i32), Arg::F32(n.eps), Arg::Ptr(n.inv)]),
        None => args.extend([Arg::I32(0), Arg::F32(0.0), Arg::Ptr(0)]),
    }
    match conv {
        Some(cv) => args.extend([Arg::Ptr(cv.state), Arg::Ptr(cv.w), Arg::I32(cv.k as i32)]),
        None => args.extend([Arg::Ptr(0), Arg::Ptr(0), Arg::I32(0)]),
    }
    args.push(Arg::I32(defer_parts as i32));
    args.push(Arg::I32(ahead_parts as i32));
    if let Some(b) = spread {
        let cap = b.ceil() as usize;
        shmem = spread_shmem_for(sms, shmem, cap * sms, (SM_SHARED / (shmem + 2048)).clamp(1, min_blocks));
    }
    // matvec_many_ahead's grid is flat: the parts' blocks one after another.
    let (kernel, grid) = if ahead_parts != 0 {
        shmem = shmem.max(ahead_shmem);
        ("matvec_many_ahead", (flat_grid as u32, 1, 1))
    } else {
        (kernel, (grid_x as u32, parts.len() as u32, 1))
    };
    // Two input rows in each block: matvec_many_48's parts and plans, the rows' staging.
    if let Some(p) = pair {
        if kernel != "matvec_many_48" || ahead_parts != 0 || defer_parts != 0 || plans.iter().any(|sp| sp.slices != 1) {
            bail!("{kernel}: two input rows in each block only for whole 4-bit parts, none deferred or ahead");
        }
        args.extend([Arg::U64((p.stride / 4) as u64), Arg::U64((p.stride / 4) as u64), Arg::Ptr(p.conv_mid)]);
        let shmem = shmem.max(2 * rows_staging_bytes(cols));
        // A flat grid: the parts' blocks one after another (see the kernel).
        gpu.launch("matvec_many_x2", (flat_grid as u32, 1, 1), threads as u32, shmem as u32, &args)?;
        return Ok(0);
    }
    // A verifying pass's rows (`Gpu::with_rows`): `matvec_many`'s launch serves them all.
    let (rows, stride) = gpu.rows();
    let (kernel, grid) = if rows > 1 {
        // The one-row kernel's code and plans: each row's sums bit for bit a step's.
        let rows_kernel = match kernel {
            "matvec_many" => "matvec_many_rows",
            "matvec_many_48" => "matvec_many_48_rows",
            _ => "",
        };
        if rows_kernel.is_empty() || conv.is_some() {
            bail!(
                "{kernel} serves one row a launch (only matvec_many and matvec_many_48 without a folded conv serve a \
                 pass's rows)"
            );
        }
        args.push(Arg::U64(stride));
        // matvec_many_48_rows' grid is flat: each row's parts' blocks one after another (see the
        // kernel).
        let grid =
            if rows_kernel == "matvec_many_48_rows" { (flat_grid as u32, 1, rows) } else { (grid.0, grid.1, rows) };
        (rows_kernel, grid)
    } else {
        (kernel, grid)
    };
    gpu.launch(kernel, grid, threads as u32, shmem as u32, &args)?;
    Ok(ahead_parts)
}

/// A zero-centred RMSNorm over groups of `group` inputs folded into a `matvec_many` launch (`MvNorm`
/// in linear.cu); the groups' 1 / rms go to `inv` (`group` floats apart in x; 0: not kept).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FoldedNorm {
    pub group: usize,
    pub eps: f32,
    pub inv: u64,
    /// Leave the first part's column slices unsummed where there is one a group
    /// ([`NormLaunch::Deferred`]; `inv` is then not written).
    pub defer: bool,
    /// With `defer`, leave the second part's slices unsummed too where it has 4 rows (the
    /// injection logits) in at most `MAX_SLICES` slices, a whole number a group
    /// ([`NormLaunch::Deferred`]'s second field, for [`hc_up_mix`]'s extra block).
    pub defer_second: bool,
}

/// What [`matvec_many_norm`] queued.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormLaunch {
    /// Nothing: the launch does not apply.
    Unfit,
    /// Every part summed (and the groups' 1 / rms written to `inv`).
    Summed,
    /// The first part left as one column slice a group, for its consumer ([`hc_up_mix`]), and
    /// the second part's slices where they were left too ([`FoldedNorm::defer_second`]).
    Deferred(DeferredSlices, Option<DeferredSlices>),
}

/// The split plans of [`matvec_many_norm`]'s parts with a norm over groups of `group` inputs;
/// None where that launch does not apply.
fn norm_plans(gpu: &Gpu, parts: &[(&DevLinear, u64)], group: usize) -> Option<Vec<SplitPlan>> {
    let &(first, _) = parts.first()?;
    let cols = first.cols;
    if parts.len() > MV_PARTS
        || group == 0
        || !cols.is_multiple_of(group)
        || !(cols / group).is_power_of_two()
        || !parts.iter().all(|(l, _)| l.cols == cols && l.tiled_shmem().is_some())
    {
        return None;
    }
    // Only `matvec_many` folds a norm (2 blocks per multiprocessor).
    let min_blocks = 2;
    parts
        .iter()
        .map(|(l, _)| {
            let Precision::Affine { bits, group_size } = l.precision else { return None };
            // At least one slice per group; doubling keeps the slices inside groups.
            let sp = split_plan_from(gpu, l.rows, cols, bits, group_size, min_blocks, cols / group, 1.0)?;
            Some(match knob_lanes("CHERENKOV_NORM_LANES") {
                Some(lanes) => {
                    let lanes = lanes.min((cols / chunk_codes(bits) / sp.slices).next_power_of_two());
                    SplitPlan { plan: TilePlan { lanes, ..sp.plan }, ..sp }
                }
                None => sp,
            })
        })
        .collect()
}

/// Lanes a tile where a measurement knob sets them (8 to 256, a power of two).
fn knob_lanes(name: &str) -> Option<usize> {
    env_count(name).filter(|l| l.is_power_of_two() && (8..=MV_THREADS).contains(l))
}

/// Whether [`matvec_many_norm`] applies to these matrices with a norm over groups of `group`
/// inputs (it queues one launch rather than returning [`NormLaunch::Unfit`]).
pub fn matvec_many_norm_fits(gpu: &Gpu, parts: &[&DevLinear], group: usize) -> bool {
    let parts: Vec<(&DevLinear, u64)> = parts.iter().map(|&l| (l, 0)).collect();
    norm_plans(gpu, &parts, group).is_some()
}

/// y_i = W_i n for every part, where n = x / rms(x) * (1 + w) per group of `norm.group` inputs (the
/// hyper-connection read's norm; `rmsnorm_zc` in ops.cu), in one launch without n: the parts stage
/// x (1 + w), each column slice lies in one group, and the slices' partial sums are scaled by their
/// group's 1 / rms as they are added up. Returns false, queueing nothing, where that does not apply
/// (more than `MV_PARTS` parts, parts of other inputs or formats the tiled kernels do not take,
/// columns that do not split into whole groups): the caller then runs the norm and
/// [`matvec_many`].
pub fn matvec_many_norm(
    gpu: &Gpu,
    x: u64,
    w: u64,
    parts: &[(&DevLinear, u64)],
    norm: FoldedNorm,
) -> Result<NormLaunch> {
    let Some(plans) = norm_plans(gpu, parts, norm.group) else { return Ok(NormLaunch::Unfit) };
    let cols = parts[0].0.cols;
    // Deferred where the first part has one slice a group of `MV_R` (hc_up_mix's streams).
    let defer = norm.defer && cols / norm.group == MV_R && plans[0].slices == MV_R;
    let defer_second = defer
        && norm.defer_second
        && parts.len() == 2
        && parts[1].0.rows == MV_R
        && plans[1].slices > 1
        && plans[1].slices <= MAX_SLICES
        && plans[1].slices.is_multiple_of(MV_R);
    let mask = u32::from(defer) | (u32::from(defer_second) << 1);
    launch_many(gpu, MatvecInput::OnePlus(x, w), parts, &plans, Some(norm), None, mask, false, None)?;
    if defer {
        let (parts, ssq) = part_scratch(gpu, 0);
        let first = DeferredSlices { parts, slices: MV_R, ssq, eps: norm.eps };
        let second = defer_second.then(|| {
            let (parts, ssq) = part_scratch(gpu, 1);
            DeferredSlices { parts, slices: plans[1].slices, ssq, eps: norm.eps }
        });
        return Ok(NormLaunch::Deferred(first, second));
    }
    Ok(NormLaunch::Summed)
}

/// The Gated DeltaNet's causal depthwise conv of `k` taps folded into the first part of a
/// `matvec_many` launch (`MvConv` in linear.cu; `gdn_conv` in gdn.cu is the same as a launch of its
/// own): that part's rows are the conv's channels, `state` its (k - 1) x rows history (oldest
/// first, shifted in place) and `w` its rows x k weights; the part's output is the conv's, after
/// silu.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FoldedConv {
    pub state: u64,
    pub w: u64,
    pub k: usize,
    /// The conv's channels: the first part's rows (otherwise nothing is folded).
    pub channels: usize,
}

/// Whether the GDN conv may ride on its input projection's launch ([`matvec_many_conv`]);
/// `CHERENKOV_NO_FOLDED_CONV` keeps it a launch of its own.
pub fn fold_conv() -> bool {
    use std::sync::OnceLock;
    static FOLD: OnceLock<bool> = OnceLock::new();
    *FOLD.get_or_init(|| std::env::var_os("CHERENKOV_NO_FOLDED_CONV").is_none())
}

/// y_i = W_i x for every part (W_i, y_i) of one input x: one launch per `MV_PARTS` parts when all
/// are affine 2-, 4- or 8-bit matrices of the same inputs that the tiled kernels take (their
/// formats may differ), each part with its own lanes, blocks and column split (`split_plan`);
/// otherwise one [`DevLinear::matvec`] per part.
pub fn matvec_many(gpu: &Gpu, x: u64, parts: &[(&DevLinear, u64)]) -> Result<()> {
    matvec_many_conv(gpu, x, parts, None).map(|_| ())
}

/// [`matvec_many`] with the weights taken ahead where that applies (`ahead`) or never, whatever
/// [`many_ahead`] says (the GPU check compares the two). Returns whether a part took them ahead.
pub fn matvec_many_ahead(gpu: &Gpu, x: u64, parts: &[(&DevLinear, u64)], ahead: bool) -> Result<bool> {
    matvec_many_with(gpu, x, parts, None, false, ahead).map(|m| m.ahead_parts != 0)
}

/// [`matvec_many`] with `conv` folded into the first part's output where the launch takes it: the
/// parts fused into one launch, the first part in one column slice with `conv.channels` rows, and
/// [`fold_conv`]. Returns whether it did; if not, the first part's output is the plain product and
/// the caller runs the conv.
pub fn matvec_many_conv(gpu: &Gpu, x: u64, parts: &[(&DevLinear, u64)], conv: Option<FoldedConv>) -> Result<bool> {
    matvec_many_with(gpu, x, parts, conv, false, many_ahead()).map(|m| m.folded)
}

/// Where a [`matvec_many_deferring`] launch left its first part's column slices: `slices` of the
/// part's rows each (slice-major) from `parts` in the split scratch, for the next kernel to add up
/// in slice order (`route_topk`'s `parts`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeferredSlices {
    pub parts: u64,
    pub slices: usize,
    /// The slices' sums of squares where the launch folded a norm ([`matvec_many_norm`]; the
    /// consumer scales each slice by its group's 1 / rms), else 0.
    pub ssq: u64,
    /// The folded norm's epsilon (0 without one).
    pub eps: f32,
}

/// The split scratch's slices of part p (`MV_SCRATCH_HEAD` floats in, `MV_PART_FLOATS` a part)
/// and their sums of squares (after every part's partial sums, `MAX_SLICES` a part).
fn part_scratch(gpu: &Gpu, p: usize) -> (u64, u64) {
    let s = gpu.split_scratch_ptr();
    (
        s + ((MV_SCRATCH_HEAD + p * MV_PART_FLOATS) * 4) as u64,
        s + ((MV_SCRATCH_HEAD + MV_PARTS * MV_PART_FLOATS + p * MAX_SLICES) * 4) as u64,
    )
}

/// [`matvec_many`], leaving the first part's column slices unsummed where the launch splits it
/// (`defer_first` in linear.cu); returns where they are, or None where the first part's output was
/// written whole. The caller's next kernel must add them up before any other split launch runs
/// (they share the scratch).
pub fn matvec_many_deferring(gpu: &Gpu, x: u64, parts: &[(&DevLinear, u64)]) -> Result<Option<DeferredSlices>> {
    matvec_many_with(gpu, x, parts, None, true, many_ahead()).map(|m| m.deferred)
}

fn matvec_many_with(
    gpu: &Gpu,
    x: u64,
    parts: &[(&DevLinear, u64)],
    conv: Option<FoldedConv>,
    defer_first: bool,
    ahead: bool,
) -> Result<ManyLaunch> {
    let mut done = ManyLaunch { folded: false, deferred: None, ahead_parts: 0 };
    let Some(&(first, _)) = parts.first() else { return Ok(done) };
    let fused = parts.len() > 1 && parts.iter().all(|(l, _)| l.cols == first.cols && l.tiled_shmem().is_some());
    if !fused {
        for &(l, y) in parts {
            l.matvec(gpu, x, y)?;
        }
        return Ok(done);
    }
    // Only a single launch defers (a later launch would write the same scratch).
    let defer_first = defer_first && parts.len() <= MV_PARTS;
    for (gi, group) in parts.chunks(MV_PARTS).enumerate() {
        let min_blocks = many_kernel(&part_bits(group)).1;
        let mut plans = Vec::with_capacity(group.len());
        let bytes: Vec<usize> = group
            .iter()
            .map(|(l, _)| match l.precision {
                Precision::Affine { bits, .. } => l.rows * l.cols * bits as usize,
                Precision::Float { .. } => 0,
            })
            .collect();
        let total = bytes.iter().sum::<usize>().max(1);
        for ((l, _), b) in group.iter().zip(&bytes) {
            let Precision::Affine { bits, group_size } = l.precision else { unreachable!("tiled formats are affine") };
            let share = if joint_many() { *b as f64 / total as f64 } else { 1.0 };
            let plan = split_plan_from(gpu, l.rows, l.cols, bits, group_size, min_blocks, 1, share)
                .expect("one slice is always a plan");
            plans.push(plan);
        }
        let conv =
            conv.filter(|c| gi == 0 && plans[0].slices == 1 && c.k > 0 && group[0].0.rows == c.channels && fold_conv());
        done.folded |= conv.is_some();
        let defer = defer_first && plans[0].slices > 1;
        done.ahead_parts |=
            launch_many(gpu, MatvecInput::Plain(x), group, &plans, None, conv, u32::from(defer), ahead, None)?;
        if defer {
            done.deferred =
                Some(DeferredSlices { parts: part_scratch(gpu, 0).0, slices: plans[0].slices, ssq: 0, eps: 0.0 });
        }
    }
    Ok(done)
}

/// [`matvec_many_conv`] over a verifying pass's two input rows in one launch whose blocks each
/// serve both rows (`matvec_many_x2`): row 1 of x and of every part's output `stride` bytes past
/// row 0's; the conv folded into the first part as the one-row launch folds it, row 0's first, the
/// state after it written to `conv_mid` (the record's copy; same layout as the state). Each row's
/// products are the one-row launch's, with its plans. Returns false, queueing nothing, where that
/// launch does not apply: more than one launch's parts, parts not all 4-bit with whole rows in one
/// slice, or a conv the one-row launch would not fold.
pub fn matvec_many_conv_x2(
    gpu: &Gpu,
    x: u64,
    stride: usize,
    parts: &[(&DevLinear, u64)],
    conv: FoldedConv,
    conv_mid: u64,
) -> Result<bool> {
    many_x2(gpu, x, stride, parts, Some((conv, conv_mid)))
}

/// [`matvec_many`] over a verifying pass's two input rows in one launch whose blocks each serve
/// both rows (`matvec_many_x2`, no conv): row 1 of x and of every part's output `stride` bytes past
/// row 0's, each row's products the one-row launch's with its plans. Returns false, queueing
/// nothing, where that launch does not apply (as [`matvec_many_conv_x2`]).
pub fn matvec_many_x2(gpu: &Gpu, x: u64, stride: usize, parts: &[(&DevLinear, u64)]) -> Result<bool> {
    many_x2(gpu, x, stride, parts, None)
}

fn many_x2(
    gpu: &Gpu,
    x: u64,
    stride: usize,
    parts: &[(&DevLinear, u64)],
    conv: Option<(FoldedConv, u64)>,
) -> Result<bool> {
    let Some(&(first, _)) = parts.first() else { return Ok(false) };
    if parts.len() < 2
        || parts.len() > MV_PARTS
        || !parts.iter().all(|(l, _)| {
            l.cols == first.cols
                && l.tiled_shmem().is_some()
                && matches!(l.precision, Precision::Affine { bits: 4, .. })
        })
        || many_spread().is_some()
        || !stride.is_multiple_of(16)
    {
        return Ok(false);
    }
    let min_blocks = many_kernel(&part_bits(parts)).1;
    let total = parts.iter().map(|(l, _)| l.rows * l.cols * 4).sum::<usize>().max(1);
    let mut plans = Vec::with_capacity(parts.len());
    for (l, _) in parts {
        let Precision::Affine { bits, group_size } = l.precision else { return Ok(false) };
        let share = if joint_many() { (l.rows * l.cols * 4) as f64 / total as f64 } else { 1.0 };
        let plan = split_plan_from(gpu, l.rows, l.cols, bits, group_size, min_blocks, 1, share)
            .expect("one slice is always a plan");
        if plan.slices != 1 {
            return Ok(false);
        }
        plans.push(plan);
    }
    if conv.is_some_and(|(c, _)| !(c.k > 0 && first.rows == c.channels && fold_conv())) {
        return Ok(false);
    }
    let pair = ManyPair { stride, conv_mid: conv.map_or(0, |(_, mid)| mid) };
    launch_many(gpu, MatvecInput::Plain(x), parts, &plans, None, conv.map(|(c, _)| c), 0, false, Some(pair))?;
    Ok(true)
}

/// What [`matvec_many_with`] queued: whether the conv was folded into the first part, where the
/// first part's slices were left, and the parts that took their weights ahead (bit p: part p of
/// any of its launches).
struct ManyLaunch {
    folded: bool,
    deferred: Option<DeferredSlices>,
    ahead_parts: u32,
}

/// Where `hc_up_mix` finds the normalised residual.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Normed {
    /// Stored (`rmsnorm_zc`).
    Stored(u64),
    /// Recomputed from the residual `x`, the norm weight `w` and the streams' 1 / rms `inv`
    /// ([`FoldedNorm::inv`]).
    Folded { x: u64, w: u64, inv: u64 },
}

/// Whether [`hc_up_mix`] takes this up projection of `hc` streams of `h`.
pub fn hc_up_mix_applies(up: &DevLinear, hc: usize, h: usize) -> bool {
    matches!(up.precision, Precision::Affine { .. }) && up.tiled_shmem().is_some() && hc == MV_R && up.rows == hc * h
}

/// The hyper-connection read's up projection and mix in one launch (`hc_up_mix` in linear.cu):
/// `out[j]` = mean over the 4 streams s of `sigmoid((W_up in(x))[s h + j]) normed[s h + j]`. Returns
/// false, queueing nothing, where the kernel does not apply ([`hc_up_mix_applies`]): the caller
/// then runs the matvec and `hc_mix`.
/// With `sum` (a [`NormLaunch::Deferred`] read of `up.cols` rows), x is that read's slices, added up
/// as they are loaded, and `normed` is folded with its 1 / rms computed from the slices. With
/// `inject` (that read's second part, the injection logits, left unsummed too, and where their sum
/// goes) one block more adds them up beside the tiles.
#[allow(clippy::too_many_arguments)]
pub fn hc_up_mix(
    gpu: &Gpu,
    up: &DevLinear,
    input: MatvecInput,
    normed: Normed,
    out: u64,
    hc: usize,
    h: usize,
    sum: Option<DeferredSlices>,
    inject: Option<(DeferredSlices, u64)>,
) -> Result<bool> {
    let (Precision::Affine { bits, group_size }, Some(shmem)) = (up.precision, up.tiled_shmem()) else {
        return Ok(false);
    };
    if !hc_up_mix_applies(up, hc, h) {
        return Ok(false);
    }
    // Tiles are columns of the output (one row of each stream); 2 blocks per multiprocessor.
    let mut plan = tile_plan(gpu, h, up.cols / chunk_codes(bits), 1, 2, shmem);
    if let Some(lanes) = knob_lanes("CHERENKOV_HC_UP_LANES") {
        plan.lanes = lanes.min((up.cols / chunk_codes(bits)).next_power_of_two());
        plan.blocks = h.div_ceil(plan.threads / plan.lanes);
    }
    let [x2, xs, op] = input.args();
    let (stored, (xr, w, inv)) = match normed {
        Normed::Stored(n) => (n, (0, 0, 0)),
        Normed::Folded { x, w, inv } => (0, (x, w, inv)),
    };
    if let Some(d) = sum
        && (stored != 0 || d.slices != MV_R || d.ssq == 0)
    {
        bail!("hc_up_mix: a deferred read must have one slice a stream ({MV_R}, not {}) and the folded norm", d.slices);
    }
    let d = sum.unwrap_or(DeferredSlices { parts: 0, slices: 0, ssq: 0, eps: 0.0 });
    if let Some((ij, _)) = inject
        && (sum.is_none() || ij.ssq == 0 || ij.slices * MV_R > plan.threads || !ij.slices.is_multiple_of(MV_R))
    {
        bail!("hc_up_mix: deferred injection logits need the deferred read and at most {} slices", plan.threads / MV_R);
    }
    let (ij, ij_out) = match inject {
        Some((ij, out)) => (ij, out),
        None => (DeferredSlices { parts: 0, slices: 0, ssq: 0, eps: 0.0 }, 0),
    };
    // A verifying pass's rows (`Gpu::with_rows`): one launch serves them all.
    let (rows, stride) = gpu.rows();
    // A pass's rows share one row's blocks (as `matvec_many_rows`' folded norm).
    let blocks = if rows > 1 && !rows_read_full() { plan.blocks.div_ceil(rows as usize) } else { plan.blocks };
    let grid = (blocks as u32 + u32::from(ij_out != 0), 1, rows);
    let mut args = vec![
        Arg::Ptr(up.data),
        Arg::Ptr(up.scales),
        Arg::Ptr(up.biases),
        Arg::Ptr(input.x()),
        x2,
        xs,
        op,
        Arg::Ptr(stored),
        Arg::Ptr(out),
        Arg::I32(h as i32),
        Arg::I32(up.cols as i32),
        Arg::I32(group_size as i32),
        Arg::I32(bits as i32),
        Arg::I32(plan.lanes as i32),
        Arg::Ptr(xr),
        Arg::Ptr(w),
        Arg::Ptr(if sum.is_some() { 0 } else { inv }),
        Arg::Ptr(d.parts),
        Arg::Ptr(d.ssq),
        Arg::F32(d.eps),
        Arg::Ptr(ij.parts),
        Arg::Ptr(ij.ssq),
        Arg::I32(ij.slices as i32),
        Arg::Ptr(ij_out),
    ];
    let kernel = if rows > 1 {
        args.push(Arg::U64(stride));
        "hc_up_mix_rows"
    } else {
        "hc_up_mix"
    };
    gpu.launch(kernel, grid, plan.threads as u32, shmem as u32, &args)?;
    Ok(true)
}

/// Where the expert kernels read and write: x (hidden floats), act (entries x intermediate) and out
/// (entries x hidden).
#[derive(Clone, Copy, Debug)]
pub struct ExpertIo {
    pub x: u64,
    pub act: u64,
    pub out: u64,
    /// Where the gate/up kernel writes the time it started (`stamp_first`, common.cuh); 0: nowhere.
    pub stamp: u64,
    /// The shared expert's down projection as the down launch's last entry, where it
    /// [`shared_rides`].
    pub shared: Option<SharedDown>,
    /// The shared expert's gate and up projections as the gate/up launch's last entry, where they
    /// [`shared_gate_up_rides`] (only beside `shared`, whose input they are).
    pub shared_gate_up: Option<SharedGateUp>,
    /// Relays of flags (device memory, each naming its flag in host memory; 0: none) the gate/up
    /// and the down launch wait for before they read their table or any record (`flag_wait`,
    /// common.cuh): a flagged streamed step's read experts, whose records may still be landing
    /// when the launch starts.
    pub wait_front: u64,
    pub wait_back: u64,
}

impl ExpertIo {
    /// Input `x`, activations `act` and outputs `out`, nothing stamped, riding or waited for.
    pub fn new(x: u64, act: u64, out: u64) -> ExpertIo {
        ExpertIo { x, act, out, stamp: 0, shared: None, shared_gate_up: None, wait_front: 0, wait_back: 0 }
    }
}

/// The shared expert's gate and up projections riding along in the routed experts' gate/up launch
/// (`SharedGateUp` in ple_moe.cu): their matrices, and where their rows go (the riding down
/// projection's `gate` and `up`). Those blocks do not wait for the router.
#[derive(Clone, Copy, Debug)]
pub struct SharedGateUp {
    pub gate: (u64, u64, u64),
    pub up: (u64, u64, u64),
    pub group_size: usize,
    pub gate_out: u64,
    pub up_out: u64,
}

/// The shared expert's down projection riding along in the routed experts' down launch (`SharedDown`
/// in ple_moe.cu): its matrix, its gate and up projections' outputs (its input is
/// silu(gate) * up, applied while staging) and where its row goes.
#[derive(Clone, Copy, Debug)]
pub struct SharedDown {
    pub data: u64,
    pub scales: u64,
    pub biases: u64,
    pub group_size: usize,
    pub gate: u64,
    pub up: u64,
    pub out: u64,
}

/// Whether the shared expert's down projection `shared` can ride along in the down launch of
/// experts of `layout` (`dims` = (intermediate, hidden), records `record_bytes` apart): the down
/// kernel is the tiled one, and `shared` is of the routed experts' format and shape with 16-byte
/// aligned pieces.
pub fn shared_rides(layout: &ExpertLayout, record_bytes: usize, shared: &DevLinear, dims: (usize, usize)) -> bool {
    let down = &layout.down_proj;
    let (inter, h) = dims;
    record_tiled(down, inter, record_bytes).is_some()
        && shared.precision == down.precision
        && (shared.rows, shared.cols) == (h, inter)
        && [shared.data, shared.scales, shared.biases].iter().all(|p| p.is_multiple_of(16))
}

/// Whether the shared expert's gate and up projections can ride along in the gate/up launch of
/// experts of `layout` (`dims` = (intermediate, hidden), records `record_bytes` apart): that kernel
/// is the tiled one, and both matrices are of the routed experts' gate/up format and shape with
/// 16-byte aligned pieces.
pub fn shared_gate_up_rides(
    layout: &ExpertLayout,
    record_bytes: usize,
    gate: &DevLinear,
    up: &DevLinear,
    dims: (usize, usize),
) -> bool {
    let (inter, h) = dims;
    let (g, u) = (&layout.gate_proj, &layout.up_proj);
    record_tiled(g, h, record_bytes).is_some()
        && record_tiled(u, h, record_bytes).is_some()
        && g.precision == u.precision
        && [gate, up].iter().all(|m| {
            m.precision == g.precision
                && (m.rows, m.cols) == (inter, h)
                && [m.data, m.scales, m.biases].iter().all(|p| p.is_multiple_of(16))
        })
}

/// The tiled expert kernels' (bits, staged bytes) for record matrix `m` of `cols` inputs, records
/// `record_bytes` apart, where they take it (2, 4 or 8 bits, 16-byte aligned pieces, a tiled shape).
fn record_tiled(m: &RecordMatrix, cols: usize, record_bytes: usize) -> Option<(u32, usize)> {
    match m.precision {
        Precision::Affine { bits, group_size }
            if [Some(m.data), m.scales, m.biases].iter().all(|s| s.is_some_and(|s| s.offset.is_multiple_of(16)))
                && record_bytes.is_multiple_of(16)
                && record_bytes / 2 <= u32::MAX as usize =>
        {
            tiled_shmem(bits, group_size, cols).map(|shmem| (bits, shmem))
        }
        _ => None,
    }
}

/// Whether `launch_experts` runs a layer's experts on the tiled core, gate/up and down both (only
/// then does it serve a verifying pass's rows); `dims` = (intermediate, hidden).
pub fn experts_tiled(layout: &ExpertLayout, record_bytes: usize, dims: (usize, usize)) -> bool {
    let (inter, h) = dims;
    let (g, u, d) = (&layout.gate_proj, &layout.up_proj, &layout.down_proj);
    record_tiled(g, h, record_bytes).is_some()
        && record_tiled(u, h, record_bytes).is_some()
        && g.precision == u.precision
        && record_tiled(d, inter, record_bytes).is_some()
}

/// Queues the gate/up and down kernels of address-table entries `first..first + n` (records of
/// `layout`, `record_bytes` apart in their pool; `dims` = (intermediate, hidden)). 2-, 4- and 8-bit
/// records of 16-byte aligned matrices take the tiled core (linear.cu): one plan for all n entries
/// (grid y), gate/up tiles of 2 rows of each, down tiles of 4 rows.
#[allow(clippy::too_many_arguments)]
pub fn launch_experts(
    g: &Gpu,
    layout: &ExpertLayout,
    record_bytes: usize,
    table: u64,
    first: usize,
    n: usize,
    io: ExpertIo,
    dims: (usize, usize),
    between: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (inter, h) = dims;
    let (mut gk, mut dk) = crate::model::expert_kernels(layout)?;
    let (gu, down) = (&layout.gate_proj, &layout.down_proj);
    // A verifying pass's rows ([`Gpu::with_rows`]): the `_rows` kernels, one grid layer a row.
    let (rows, rs) = g.rows();
    let gs = |m: &RecordMatrix| match m.precision {
        Precision::Affine { group_size, .. } => group_size as i32,
        _ => 1,
    };
    let off = |s: Option<cherenkov_model::store::Span>| s.map_or(0, |s| s.offset);
    let staged = |bits_of: &RecordMatrix, n: usize| match bits_of.precision {
        Precision::Affine { bits: 2 | 4 | 8, .. } => (n * 4) as u32,
        _ => 0,
    };
    let tiled = |m: &RecordMatrix, cols: usize| record_tiled(m, cols, record_bytes);
    let up = &layout.up_proj;
    let plan = |rows: usize, tile_rows: usize, cols: usize, bits: u32, shmem: usize, copies: usize| {
        let min_blocks = if bits == 2 { 2 } else { 3 };
        let (tiles, chunks) = (rows.div_ceil(tile_rows), cols / (128 / bits as usize));
        let p = plan_tiles(sms(g), expert_threads_per_sm(), tiles, chunks, copies, min_blocks, shmem, 1.0);
        (p.blocks as u32, p.threads as u32, shmem as u32, MV_TILED | p.lanes)
    };
    // Experts fill the GPU together: rows per block from the rows of all entries.
    let gate_up_tiled = tiled(gu, h).filter(|_| tiled(up, h).is_some() && gs(gu) == gs(up));
    // The shared expert's gate and up ride along as entry n (the caller checked
    // `shared_gate_up_rides`), only with its down projection riding in the down launch.
    let shared_gu = io.shared_gate_up.filter(|_| gate_up_tiled.is_some() && io.shared.is_some());
    if io.shared_gate_up.is_some() && shared_gu.is_none() {
        bail!(
            "{}: the shared expert's gate and up cannot ride along in this layer's gate/up launch (see \
             shared_gate_up_rides)",
            layout.layer
        );
    }
    if rows > 1 {
        if !experts_tiled(layout, record_bytes, dims) || io.stamp != 0 || io.wait_front != 0 || io.wait_back != 0 {
            bail!(
                "{}: a verifying pass's rows run the tiled expert kernels only, unstamped and unflagged",
                layout.layer
            );
        }
        // Each row takes one row's plan (a grid as deep as the rows), so that its sums are a
        // step's bit for bit: the lanes a tile gets depend on the entries planned for (`plan_tiles`).
        gk = gk.replacen("_q", "_rows_q", 1);
        dk = dk.replacen("_q", "_rows_q", 1);
    }
    let ng = n + usize::from(shared_gu.is_some());
    let (gb, gt, gsh, rpb_g) = match gate_up_tiled {
        Some((bits, shmem)) => plan(inter, 2, h, bits, shmem, ng),
        None => {
            let r = rows_per_block(inter * n, BLOCKS_WANTED);
            (blocks(inter, r), 256, staged(gu, h), r)
        }
    };
    // The shared expert rides along as entry n (the caller checked `shared_rides`): one plan for
    // n + 1 entries.
    let shared = io.shared.filter(|_| tiled(down, inter).is_some());
    if io.shared.is_some() && shared.is_none() {
        bail!("{}: the shared expert cannot ride along in this layer's down launch (see shared_rides)", layout.layer);
    }
    let nd = n + usize::from(shared.is_some());
    let (db, dt, dsh, rpb_d) = match tiled(down, inter) {
        Some((bits, shmem)) => plan(h, 4, inter, bits, shmem, nd),
        None => {
            let r = rows_per_block(h * n, BLOCKS_WANTED);
            (blocks(h, r), 256, staged(down, inter), r)
        }
    };
    // A verifying pass's rows divide one row's blocks among them, the lanes a tile kept (a block
    // takes its tiles in several grid-stride passes, each row's sums still a step's), so that the
    // rows' grid holds what one row's does (`CHERENKOV_ROWS_EXPERTS_FULL=1`: each row a step's
    // blocks, as before session 53).
    let divided = rows > 1 && !rows_experts_full();
    // `grids`: the row grids whose blocks the spread counts (divided: every row's; undivided: one, as before).
    let (gb, db, grids) = if divided { (gb.div_ceil(rows), db.div_ceil(rows), rows as usize) } else { (gb, db, 1) };
    // The tiled launches are spread out ([`spread_experts`]), where the rows' blocks are divided
    // over the whole grid's blocks (every row's); the others stay as planned.
    let spread = |t: Option<(u32, usize)>, shmem: u32, working: usize| match t {
        Some((bits, _)) if spread_experts() => {
            spread_shmem(sms(g), shmem as usize, working, if bits == 2 { 2 } else { 3 }) as u32
        }
        _ => shmem,
    };
    let gsh = spread(gate_up_tiled, gsh, gb as usize * ng * grids);
    let dsh = spread(tiled(down, inter), dsh, db as usize * nd * grids);
    let row_stride = (rows > 1).then_some(Arg::U64(rs));
    let sh = shared.unwrap_or(SharedDown { data: 0, scales: 0, biases: 0, group_size: 1, gate: 0, up: 0, out: 0 });
    let shg =
        shared_gu.unwrap_or(SharedGateUp { gate: (0, 0, 0), up: (0, 0, 0), group_size: 1, gate_out: 0, up_out: 0 });
    let gate_up_args = [
        Arg::Ptr(table),
        Arg::I32(first as i32),
        Arg::Ptr(io.x),
        Arg::Ptr(io.act),
        Arg::I32(inter as i32),
        Arg::I32(h as i32),
        Arg::I32(gs(gu)),
        Arg::I32(rpb_g as i32),
        Arg::U64(gu.data.offset),
        Arg::U64(off(gu.scales)),
        Arg::U64(off(gu.biases)),
        Arg::U64(layout.up_proj.data.offset),
        Arg::U64(off(layout.up_proj.scales)),
        Arg::U64(off(layout.up_proj.biases)),
        Arg::Ptr(io.stamp),
        Arg::Ptr(shg.gate.0),
        Arg::Ptr(shg.gate.1),
        Arg::Ptr(shg.gate.2),
        Arg::Ptr(shg.up.0),
        Arg::Ptr(shg.up.1),
        Arg::Ptr(shg.up.2),
        Arg::I32(shg.group_size as i32),
        Arg::Ptr(shg.gate_out),
        Arg::Ptr(shg.up_out),
        Arg::Ptr(io.wait_front),
    ];
    let args: Vec<Arg> = gate_up_args.into_iter().chain(row_stride).collect();
    g.launch(&gk, (gb, ng as u32, rows), gt, gsh, &args)?;
    between()?;
    let down_args = [
        Arg::Ptr(table),
        Arg::I32(first as i32),
        Arg::Ptr(io.act),
        Arg::Ptr(io.out),
        Arg::I32(inter as i32),
        Arg::I32(h as i32),
        Arg::I32(gs(down)),
        Arg::I32(rpb_d as i32),
        Arg::U64(down.data.offset),
        Arg::U64(off(down.scales)),
        Arg::U64(off(down.biases)),
        Arg::Ptr(sh.data),
        Arg::Ptr(sh.scales),
        Arg::Ptr(sh.biases),
        Arg::I32(sh.group_size as i32),
        Arg::Ptr(sh.gate),
        Arg::Ptr(sh.up),
        Arg::Ptr(sh.out),
        Arg::Ptr(io.wait_back),
    ];
    let args: Vec<Arg> = down_args.into_iter().chain(row_stride).collect();
    g.launch(&dk, (db, nd as u32, rows), dt, dsh, &args)
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
    /// The MTP head (`mtp.*`), where the checkpoint has one.
    pub mtp: Option<Mtp>,
}

/// The MTP head on the device: the CPU's `MtpWeights`, bound to the same dense upload.
pub struct Mtp {
    pub fc_embedding: DevLinear,
    pub fc_hidden: DevLinear,
    pub pre_fc_norm_embedding: DevBuf,
    pub pre_fc_norm_hidden: DevBuf,
    pub hyper_connection_mixer: HyperConnection,
    pub layers: Vec<MtpLayer>,
}

/// One layer of the MTP head: QSA attention and MoE with their hyper-connections (no PLE).
pub struct MtpLayer {
    pub attn_hc: HyperConnection,
    pub attention: Attention,
    pub mlp_hc: HyperConnection,
    pub moe: Moe,
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
        let mtp = match &w.mtp {
            Some(m) => Some(Mtp {
                fc_embedding: b.lin(&m.fc_embedding),
                fc_hidden: b.lin(&m.fc_hidden),
                pre_fc_norm_embedding: b.vec(&m.pre_fc_norm_embedding, "MTP pre_fc_norm_embedding")?,
                pre_fc_norm_hidden: b.vec(&m.pre_fc_norm_hidden, "MTP pre_fc_norm_hidden")?,
                hyper_connection_mixer: b.hc(&m.hyper_connection_mixer)?,
                layers: m
                    .layers
                    .iter()
                    .map(|l| {
                        Ok(MtpLayer {
                            attn_hc: b.hc(&l.attn_hc)?,
                            attention: b.attention(&l.attention)?,
                            mlp_hc: b.hc(&l.mlp_hc)?,
                            moe: b.moe(&l.moe),
                        })
                    })
                    .collect::<Result<_>>()?,
            }),
            None => None,
        };
        Ok(DeviceWeights {
            mtp,
            embed_tokens: b.lin(&w.embed_tokens),
            hyper_connection_mixer: b.hc(&w.hyper_connection_mixer)?,
            lm_head: b.lin(&w.lm_head),
            layers,
            dense,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_staged_row_of_digits_takes_3_75_bytes_an_input_and_the_released_rows_fit_four_at_once() {
        // 7 uint4 of digits a chunk of 32 inputs, and its (xs, sum) float2 padded to whole uint4.
        assert_eq!(rows_staging_bytes(2560), 2560 * 15 / 4);
        assert_eq!(rows_staging_bytes(6144), 6144 * 15 / 4);
        // An odd number of chunks pads the last float2: 3 chunks are 3 x 112 + 32 bytes.
        assert_eq!(rows_staging_bytes(96), 3 * 112 + 32);
        // Never more than one row's float staging (what the one-row kernels are given).
        for cols in [640, 2560, 6144] {
            assert!(rows_staging_bytes(cols) <= tiled_shmem(4, 64, cols).unwrap());
        }
        // Four rows of the widest 4-bit input of the released shape (the out_proj's 6144) fit.
        assert!(4 * rows_staging_bytes(6144) <= MAX_STAGED_X);
    }

    #[test]
    fn the_tiled_cores_offsets_fit_32_bits_for_the_released_shapes_and_not_beyond() {
        // lm_head: 248320 x 2560, 4-bit g64: 80 chunks and 40 groups a row.
        assert!(offsets_fit_u32(248_320, 2560, 4, 64));
        // 2-bit g32 rows have more groups (80) than chunks (40): the groups count.
        assert!(offsets_fit_u32((u32::MAX / 80) as usize, 2560, 2, 32));
        assert!(!offsets_fit_u32((u32::MAX / 80) as usize + 1, 2560, 2, 32));
        assert!(!offsets_fit_u32(1 << 40, 2560, 4, 64));
        assert!(!offsets_fit_u32(usize::MAX, 2560, 4, 64), "the product overflows usize");
    }

    #[test]
    fn spreading_pads_shared_memory_to_the_blocks_a_multiprocessor_should_take() {
        let fits = |shmem: usize| SM_SHARED / (shmem + 1024);
        // Ten experts' down launch on an H200 with the shared expert riding: 220 blocks, 3 fit by
        // registers: 2 to a multiprocessor.
        let s = spread_shmem_for(132, 20 << 10, 220, 3);
        assert_eq!(fits(s), 2);
        // A streamed block's read experts, 40 blocks: 1.
        assert_eq!(fits(spread_shmem_for(132, 20 << 10, 40, 3)), 1);
        // Blocks enough for every slot, or staging already as large: unchanged.
        assert_eq!(spread_shmem_for(132, 20 << 10, 320, 3), 20 << 10);
        assert_eq!(spread_shmem_for(132, 120 << 10, 129, 2), 120 << 10);
        // Never past what the kernels may ask for.
        assert!(spread_shmem_for(8, 1024, 1, 8) <= MAX_STAGED_X);
    }

    #[test]
    fn a_spread_many_launch_plans_fewer_blocks_a_wave_and_pads_to_its_ceiling() {
        // Unset: the resident blocks (3 of matvec_many_48 on 132 multiprocessors), the part's share.
        assert_eq!(many_wave(132, 3, 1.0, None), 396);
        assert_eq!(many_wave(132, 3, 0.5, None), 198);
        // 1.5 a multiprocessor: 198 blocks in the wave, at most 2 fit on one.
        assert_eq!(many_wave(132, 3, 1.0, Some(1.5)), 198);
        let fits = |shmem: usize| SM_SHARED / (shmem + 1024);
        assert_eq!(fits(spread_shmem_for(132, 12 << 10, 2 * 132, 3)), 2);
        // Never more than fit anyway, and never an empty wave.
        assert_eq!(many_wave(132, 3, 1.0, Some(5.0)), 396);
        assert_eq!(many_wave(132, 3, 0.001, Some(0.5)), 1);
    }

    /// The released shape's plans on an H200 (132 multiprocessors, the default 512 threads each).
    fn h200(rows: usize, cols: usize, bits: u32, gs: usize, copies: usize, min_blocks: usize) -> TilePlan {
        let shmem = tiled_shmem(bits, gs, cols).expect("a tiled shape");
        plan_tiles(132, 512, rows.div_ceil(MV_R), cols / chunk_codes(bits), copies, min_blocks, shmem, 1.0)
    }

    /// A 4-bit g64 matrix of `rows` x 2560 at aligned addresses, and a one-slice plan of `lanes`.
    fn q4(rows: usize, lanes: usize) -> (DevLinear, SplitPlan) {
        let lin = DevLinear {
            precision: Precision::Affine { bits: 4, group_size: 64 },
            rows,
            cols: 2560,
            data: 1 << 20,
            scales: 2 << 20,
            biases: 3 << 20,
        };
        let plan = SplitPlan { slices: 1, plan: TilePlan { lanes, threads: 256, blocks: 1 }, shmem: 10560, share: 1.0 };
        (lin, plan)
    }

    #[test]
    fn the_gdn_input_projections_large_parts_take_their_weights_ahead_and_the_small_ones_do_not() {
        // qkv: 16 tiles of 16 lanes a block, 160 blocks cover its 2560 tiles in one pass: x's
        // staging (2560 floats and 80 sums, to 128 bytes), 64 rows of 80 chunks and 40 scales
        // and biases, 8 mbarriers. Two such blocks fit a multiprocessor.
        let (qkv, plan) = q4(10240, 16);
        let bytes = ahead_bytes(&qkv, &plan, 256, 160);
        assert_eq!(bytes, Some(10624 + 64 * (80 * 16 + 40 * 4) + 64));
        assert!(2 * (bytes.unwrap() + 1024) <= SM_SHARED);
        // Not in one pass: some blocks would need a second.
        assert_eq!(ahead_bytes(&qkv, &plan, 256, 159), None);
        // b (48 rows) with 8 lanes: a block of 128 rows would not fit the shared memory.
        let (b, plan8) = q4(48, 8);
        assert_eq!(ahead_bytes(&b, &plan8, 256, 1), None);
        // Wider tiles, column slices, other widths, unaligned scales: never.
        let (lin, wide) = q4(10240, 64);
        assert_eq!(ahead_bytes(&lin, &wide, 256, 2560), None);
        let sliced = SplitPlan { slices: 2, ..plan };
        assert_eq!(ahead_bytes(&qkv, &sliced, 256, 160), None);
        let q8 = DevLinear { precision: Precision::Affine { bits: 8, group_size: 64 }, ..qkv };
        assert_eq!(ahead_bytes(&q8, &plan, 256, 160), None);
        let unaligned = DevLinear { scales: qkv.scales + 8, ..qkv };
        assert_eq!(ahead_bytes(&unaligned, &plan, 256, 160), None);
    }

    #[test]
    fn a_projection_too_big_for_one_wave_takes_fewer_lanes_and_one_pass() {
        // GDN in_proj_qkv (10240 x 2560, 4-bit) with 2 blocks per multiprocessor (`matvec_many`
        // with a 2-bit part): 32 lanes would need 320 blocks of 8 tiles against 264 resident (a
        // partial second pass of 3 steps); 16 lanes need 160 blocks of 16 tiles, one pass of 5.
        assert_eq!(h200(10240, 2560, 4, 64, 1, 2), TilePlan { lanes: 16, threads: 256, blocks: 160 });
        // Attention q_proj (12288 rows) likewise.
        assert_eq!(h200(12288, 2560, 4, 64, 1, 2).lanes, 16);
        // With 3 blocks per multiprocessor (`matvec_many_48`, the released formats) 396 are
        // resident: 32 lanes and one pass.
        assert_eq!(h200(10240, 2560, 4, 64, 1, 3), TilePlan { lanes: 32, threads: 256, blocks: 320 });
    }

    #[test]
    fn shapes_that_fit_one_wave_keep_their_lanes() {
        // in_proj_z (6144 x 2560): 192 blocks of 8 tiles fit in one wave.
        assert_eq!(h200(6144, 2560, 4, 64, 1, 2), TilePlan { lanes: 32, threads: 256, blocks: 192 });
        // GDN out_proj (2560 x 6144, matvec_q4 with 3 blocks per multiprocessor).
        assert_eq!(h200(2560, 6144, 4, 64, 1, 3), TilePlan { lanes: 128, threads: 256, blocks: 320 });
        // lm_head (248320 rows) starts at the fewest lanes and loops over its tiles.
        let lm = h200(248320, 2560, 4, 64, 1, 3);
        assert_eq!((lm.lanes, lm.threads, lm.blocks), (8, 256, 396));
        // Ten experts' gate/up (MV_GATE_UP tiles of 2 rows: 320 per expert, grid y 10).
        let gu = plan_tiles(132, 512, 320, 2560 / 32, 10, 3, tiled_shmem(4, 64, 2560).unwrap(), 1.0);
        assert_eq!((gu.lanes, gu.blocks), (32, 40));
        // At the experts' own target: 16 lanes and 20 blocks; their down projections (2560 rows
        // of 640 inputs, 640 tiles) 8 lanes and 20 blocks.
        let gu = plan_tiles(132, EXPERT_THREADS_PER_SM, 320, 80, 10, 3, tiled_shmem(4, 64, 2560).unwrap(), 1.0);
        assert_eq!((gu.lanes, gu.blocks), (16, 20));
        let down = plan_tiles(132, EXPERT_THREADS_PER_SM, 640, 20, 10, 3, tiled_shmem(4, 64, 640).unwrap(), 1.0);
        assert_eq!((down.lanes, down.blocks), (8, 20));
    }

    #[test]
    fn parts_planned_jointly_fill_one_wave_together() {
        // The GDN input projection's qkv (10240 rows) and z (6144) parts planned alone take 320
        // and 384 blocks against the 396 that `matvec_many_48` keeps resident; each given its
        // share of the bytes (b and a are 48 rows each) they fit one wave together.
        let shmem = tiled_shmem(4, 64, 2560).unwrap();
        let rows = [10240usize, 6144, 48, 48];
        let total: usize = rows.iter().sum();
        let alone: usize = rows.iter().map(|&r| plan_tiles(132, 512, r / 4, 80, 1, 3, shmem, 1.0).blocks).sum();
        assert!(alone > 396, "{alone}");
        let joint: Vec<TilePlan> =
            rows.iter().map(|&r| plan_tiles(132, 512, r / 4, 80, 1, 3, shmem, r as f64 / total as f64)).collect();
        let blocks: usize = joint.iter().map(|p| p.blocks).sum();
        assert!(blocks <= 396, "{joint:?}");
        assert_eq!(joint[0], TilePlan { lanes: 16, threads: 256, blocks: 160 });
    }

    /// A record of the released expert shape (intermediate 640, hidden 2560) in `bits`/`gs`, its
    /// matrices 16-byte aligned, and a dense shared down projection of `rows` x `cols` in `shared`
    /// at addresses `at`.
    fn rider(bits: u32, gs: usize, shared: Precision, rows: usize, cols: usize, at: u64) -> (ExpertLayout, DevLinear) {
        use cherenkov_model::store::{RecordMatrix, Span};
        let (inter, h) = (640usize, 2560usize);
        let mut next = 0u64;
        let mut span = |bytes: usize| {
            let s = Span { offset: next, len: bytes as u64 };
            next += (bytes as u64).next_multiple_of(16);
            s
        };
        let mut m = |r: usize, c: usize| RecordMatrix {
            shape: [r, c],
            precision: Precision::Affine { bits, group_size: gs },
            data: span(r * c * bits as usize / 8),
            scales: Some(span(r * c / gs * 2)),
            biases: Some(span(r * c / gs * 2)),
        };
        let layout = ExpertLayout {
            layer: "layers.0".into(),
            gate_proj: m(inter, h),
            up_proj: m(inter, h),
            down_proj: m(h, inter),
        };
        let lin = DevLinear { precision: shared, rows, cols, data: at, scales: at + 0x10_0000, biases: at + 0x20_0000 };
        (layout, lin)
    }

    #[test]
    fn the_shared_expert_rides_along_only_in_the_experts_format_and_shape() {
        let q4 = Precision::Affine { bits: 4, group_size: 64 };
        let dims = (640, 2560);
        let (layout, lin) = rider(4, 64, q4, 2560, 640, 0x7f00_0000);
        assert!(shared_rides(&layout, 4096 * 700, &lin, dims));
        // Another format (the mixed conversions' 8-bit shared experts), another group size.
        let (layout, lin) = rider(4, 64, Precision::Affine { bits: 8, group_size: 64 }, 2560, 640, 0x7f00_0000);
        assert!(!shared_rides(&layout, 4096 * 700, &lin, dims));
        let (layout, lin) = rider(4, 64, Precision::Affine { bits: 4, group_size: 32 }, 2560, 640, 0x7f00_0000);
        assert!(!shared_rides(&layout, 4096 * 700, &lin, dims));
        // A shared expert wider than the routed ones (the golden fixture tiny-a: 96 against 64).
        let (layout, lin) = rider(4, 64, q4, 2560, 960, 0x7f00_0000);
        assert!(!shared_rides(&layout, 4096 * 700, &lin, dims));
        // Its matrix not 16-byte aligned, or the records not 16 bytes apart.
        let (layout, lin) = rider(4, 64, q4, 2560, 640, 0x7f00_0008);
        assert!(!shared_rides(&layout, 4096 * 700, &lin, dims));
        let (layout, lin) = rider(4, 64, q4, 2560, 640, 0x7f00_0000);
        assert!(!shared_rides(&layout, 4096 * 700 + 8, &lin, dims));
        // Experts the tiled kernels do not take (3 bits): no down launch to ride in.
        let q3 = Precision::Affine { bits: 3, group_size: 64 };
        let (layout, lin) = rider(3, 64, q3, 2560, 640, 0x7f00_0000);
        assert!(!shared_rides(&layout, 4096 * 700, &lin, dims));
    }

    #[test]
    fn the_shared_gate_and_up_ride_along_only_in_the_experts_gate_up_format_and_shape() {
        let q4 = Precision::Affine { bits: 4, group_size: 64 };
        let dims = (640, 2560);
        let lin = |p: Precision, rows: usize, cols: usize, at: u64| DevLinear {
            precision: p,
            rows,
            cols,
            data: at,
            scales: at + 0x10_0000,
            biases: at + 0x20_0000,
        };
        let (layout, _) = rider(4, 64, q4, 2560, 640, 0);
        let (g, u) = (lin(q4, 640, 2560, 0x7f00_0000), lin(q4, 640, 2560, 0x7e00_0000));
        assert!(shared_gate_up_rides(&layout, 4096 * 700, &g, &u, dims));
        // Either matrix in another format or group size, or another shape (down's), or unaligned.
        let q8 = Precision::Affine { bits: 8, group_size: 64 };
        assert!(!shared_gate_up_rides(&layout, 4096 * 700, &lin(q8, 640, 2560, 0x7f00_0000), &u, dims));
        let g32 = Precision::Affine { bits: 4, group_size: 32 };
        assert!(!shared_gate_up_rides(&layout, 4096 * 700, &g, &lin(g32, 640, 2560, 0x7e00_0000), dims));
        assert!(!shared_gate_up_rides(&layout, 4096 * 700, &g, &lin(q4, 2560, 640, 0x7e00_0000), dims));
        assert!(!shared_gate_up_rides(&layout, 4096 * 700, &g, &lin(q4, 960, 2560, 0x7e00_0000), dims));
        assert!(!shared_gate_up_rides(&layout, 4096 * 700, &lin(q4, 640, 2560, 0x7f00_0004), &u, dims));
        // Records not 16 bytes apart, or experts the tiled kernels do not take (3 bits).
        assert!(!shared_gate_up_rides(&layout, 4096 * 700 + 8, &g, &u, dims));
        let q3 = Precision::Affine { bits: 3, group_size: 64 };
        let (layout3, _) = rider(3, 64, q3, 2560, 640, 0);
        let (g3, u3) = (lin(q3, 640, 2560, 0x7f00_0000), lin(q3, 640, 2560, 0x7e00_0000));
        assert!(!shared_gate_up_rides(&layout3, 4096 * 700, &g3, &u3, dims));
    }
}
