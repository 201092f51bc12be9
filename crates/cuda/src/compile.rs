//! The kernels' CUDA C sources and their compilation by NVRTC.
//!
//! Kernels are compiled at run time for the device's own architecture (`sm_90` on Hopper), so the
//! binary carries no PTX that a driver might be too old to load. The same compilation runs in CI
//! without a GPU (NVRTC from the `nvidia-cuda-nvrtc` wheel): a kernel that does not compile fails
//! the test suite.

use anyhow::{Context, Result, bail};

/// The sources, in the order they are concatenated (helpers first).
pub const SOURCES: [(&str, &str); 6] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("linear.cu", include_str!("kernels/linear.cu")),
    ("ops.cu", include_str!("kernels/ops.cu")),
    ("gdn.cu", include_str!("kernels/gdn.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("ple_moe.cu", include_str!("kernels/ple_moe.cu")),
];

/// Every kernel the backend launches (checked to exist after compilation).
pub const KERNELS: &[&str] = &[
    "matvec_q2",
    "matvec_q3",
    "matvec_q4",
    "matvec_q4_x2",
    "matvec_q4_x4",
    "matvec_q5",
    "matvec_q6",
    "matvec_q8",
    "matvec_many",
    "matvec_many_48",
    "matvec_many_48_rows",
    "matvec_many_ahead",
    "matvec_many_rows",
    "matvec_many_x2",
    "mvd_image",
    "hc_up_mix",
    "hc_up_mix_rows",
    "matvec_float",
    "embed_row",
    "rmsnorm_zc",
    "scale_silu",
    "hc_mix",
    "hc_inject",
    "add_streams",
    "copy_spans",
    "silu_mul",
    "mul_sigmoid",
    "norm_rope",
    "gdn_conv",
    "gdn_recurrent",
    "gdn_recurrent_split",
    "gdn_recurrent_rows",
    "split_q_gate",
    "kv_append",
    "qsa_pool_block",
    "qsa_scores",
    "attend",
    "attend_cl",
    "attn_prep",
    "ple_gate",
    "ple_conv",
    "route_topk",
    "route_topk_rows",
    "expert_gate_up_q2",
    "expert_gate_up_q3",
    "expert_gate_up_q4",
    "expert_gate_up_q5",
    "expert_gate_up_q6",
    "expert_gate_up_q8",
    "expert_down_q2",
    "expert_down_q3",
    "expert_down_q4",
    "expert_down_q5",
    "expert_down_q6",
    "expert_down_q8",
    "expert_gate_up_rows_q2",
    "expert_gate_up_rows_q4",
    "expert_gate_up_rows_q8",
    "expert_down_rows_q2",
    "expert_down_rows_q4",
    "expert_down_rows_q8",
    "moe_combine",
    "moe_combine_rows",
    "top_candidates",
    "top_candidates_part",
    "top_candidates_merge",
];

/// Kernels that stage their input vector in dynamic shared memory (launch with cols * 4 bytes; the
/// 3-, 5- and 6-bit matvecs only with an input transform, padded: `DevLinear::matvec_in`).
pub const STAGES_X: &[&str] = &[
    "matvec_q2",
    "matvec_q3",
    "matvec_q4",
    "matvec_q4_x2",
    "matvec_q4_x4",
    "matvec_q5",
    "matvec_q6",
    "matvec_q8",
    "matvec_many",
    "matvec_many_48",
    "matvec_many_48_rows",
    "matvec_many_ahead",
    "matvec_many_rows",
    "matvec_many_x2",
    "hc_up_mix",
    "hc_up_mix_rows",
    "matvec_float",
    "expert_gate_up_q2",
    "expert_gate_up_q4",
    "expert_gate_up_q8",
    "expert_down_q2",
    "expert_down_q4",
    "expert_down_q8",
    "expert_gate_up_rows_q2",
    "expert_gate_up_rows_q4",
    "expert_gate_up_rows_q8",
    "expert_down_rows_q2",
    "expert_down_rows_q4",
    "expert_down_rows_q8",
];

/// The whole program, each file preceded by a `#line` so compiler messages name the file.
pub fn source() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// Shared-library names NVRTC may have (CUDA 13 first).
const NVRTC_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so", "libnvrtc.so.12"];

/// Whether an NVRTC library can be loaded (checked before cudarc touches it, since a missing
/// library would otherwise end the process).
pub fn nvrtc_available() -> bool {
    NVRTC_NAMES.iter().any(|n| {
        // SAFETY: loading NVRTC runs no initialisers with preconditions; it is unloaded at once.
        unsafe { libloading::Library::new(n) }.is_ok()
    })
}

/// Compiles the kernels to PTX for `arch` (e.g. "sm_90").
pub fn compile(arch: &'static str) -> Result<String> {
    compile_with(arch, &[])
}

/// NVRTC options for `CHERENKOV_KERNEL_DEFINES`: names (or NAME=value) separated by spaces or commas
/// (tools/gpu/ab.sh passes them as one word).
fn define_options(defs: &str) -> Vec<String> {
    defs.split(|c: char| c.is_whitespace() || c == ',').filter(|d| !d.is_empty()).map(|d| format!("-D{d}")).collect()
}

/// Compiles the kernels with names `defines` defined, besides those of `CHERENKOV_KERNEL_DEFINES`
/// (`TIMELINE` for the kernel timeline: `Gpu::new`).
pub fn compile_with(arch: &'static str, defines: &[&str]) -> Result<String> {
    compile_program(arch, defines, "")
}

/// Compiles the kernels followed by `extra` (a probe's kernels, which may call the engine's
/// device functions), as [`compile`] does: the same options and `CHERENKOV_KERNEL_DEFINES`.
pub fn compile_with_extra(arch: &'static str, extra: &str) -> Result<String> {
    compile_program(arch, &[], extra)
}

fn compile_program(arch: &'static str, defines: &[&str], extra: &str) -> Result<String> {
    if !nvrtc_available() {
        bail!(
            "NVRTC (libnvrtc.so.13) was not found: the CUDA kernels are compiled at run time. Install the CUDA 13 \
             toolkit or `pip install nvidia-cuda-nvrtc==13.0.88` and add its lib directory to LD_LIBRARY_PATH"
        );
    }
    let mut options = vec!["--std=c++17".to_string(), "-default-device".into()];
    // Kernel variants for measurements (e.g. MV_NO_DP4A).
    if let Ok(defs) = std::env::var("CHERENKOV_KERNEL_DEFINES") {
        options.extend(define_options(&defs));
    }
    options.extend(defines.iter().map(|d| format!("-D{d}")));
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options,
        // Keep IEEE division and square root: the kernels are checked against the CPU reference.
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(true),
        name: Some("cherenkov.cu".into()),
        ..Default::default()
    };
    let program = if extra.is_empty() { source() } else { format!("{}#line 1 \"extra\"\n{extra}\n", source()) };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(program, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            anyhow::anyhow!("the CUDA kernels do not compile:\n{}", log.to_string_lossy())
        }
        other => anyhow::anyhow!("NVRTC failed: {other:?}"),
    })?;
    let text = ptx.to_src();
    for k in KERNELS {
        if !text.contains(&format!(".entry {k}(")) {
            bail!("kernel {k} is missing from the compiled program");
        }
    }
    Ok(text)
}

/// The `sm_XY` name of a compute capability.
pub fn arch_name(major: i32, minor: i32) -> Result<&'static str> {
    Ok(match (major, minor) {
        (9, 0) => "sm_90",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (7, 5) => "sm_75",
        (m, n) => {
            return Err(anyhow::anyhow!("compute capability {m}.{n} is not supported (Turing or newer is needed)"))
                .context("choosing the kernels' architecture");
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_defines_split_on_spaces_and_commas() {
        assert_eq!(define_options("A B"), ["-DA", "-DB"]);
        assert_eq!(define_options("A,B=8 , C"), ["-DA", "-DB=8", "-DC"]);
        assert!(define_options(" , ").is_empty());
    }
}
