//! Free disk space checks before a download or a pack starts.

use std::path::PathBuf;

use anyhow::{Result, bail};
use cherenkov_hub::disk::{Space, space};
use indicatif::HumanBytes;

/// Space one step needs in one directory.
#[derive(Clone, Debug)]
pub struct Need {
    /// What it is for: `to download`, `for the packed store`.
    pub what: &'static str,
    pub dir: PathBuf,
    pub bytes: u64,
}

/// About how large the store packed from `weights` bytes of safetensors will be: MLX weights are
/// kept as they are; BF16 weights become 4-bit groups of 64 (4.5 bits per weight with scales and
/// biases, a little more for 8-bit routers and tensors kept in bf16). 5 % and 16 MiB of slack
/// cover alignment padding and the side files.
pub fn store_estimate(weights: u64, quantized: bool) -> u64 {
    let ratio = if quantized { 1.0 } else { 0.32 };
    (weights as f64 * ratio * 1.05) as u64 + (16 << 20)
}

/// What a failed check suggests, after its figures (for a download or a pack).
const HINT: &str = "Free some space (cherenkov model gc deletes unused stores), or point HF_HUB_CACHE or CHERENKOV_HOME at a larger disk";

/// Checks that the file systems holding the directories have room for what is needed in them
/// (directories on one file system add up). Returns a line that says how much is needed and free.
pub fn check(needs: &[Need]) -> Result<String> {
    check_with(needs, space, HINT)
}

/// [`check_hinted`] with the file systems' space from `space_of` (tests give their own).
pub fn check_with(needs: &[Need], space_of: impl Fn(&std::path::Path) -> Result<Space>, hint: &str) -> Result<String> {
    let total: u64 = needs.iter().map(|n| n.bytes).sum();
    let parts: Vec<String> =
        needs.iter().map(|n| format!("{} {} in {}", HumanBytes(n.bytes), n.what, n.dir.display())).collect();
    let mut groups: Vec<(Space, u64, Vec<&Need>)> = Vec::new();
    for n in needs {
        let s = space_of(&n.dir)?;
        match groups.iter_mut().find(|g| g.0.device == s.device) {
            Some(g) => {
                g.1 += n.bytes;
                g.2.push(n);
            }
            None => groups.push((s, n.bytes, vec![n])),
        }
    }
    let needed = format!("needs about {} ({})", HumanBytes(total), parts.join(", "));
    for (s, want, members) in &groups {
        if *want > s.free {
            bail!(
                "not enough free disk space: this {needed}; the file system of {} has {} free, {} short. {hint}",
                members[0].dir.display(),
                HumanBytes(s.free),
                HumanBytes(want - s.free)
            );
        }
    }
    let free: Vec<String> = if groups.len() == 1 {
        vec![format!("{} free", HumanBytes(groups[0].0.free))]
    } else {
        groups.iter().map(|g| format!("{} free for {}", HumanBytes(g.0.free), g.2[0].dir.display())).collect()
    };
    Ok(format!("{needed}; {}", free.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_up_per_file_system() {
        let need = |what, dir: &str, bytes| Need { what, dir: dir.into(), bytes };
        let fs = |p: &std::path::Path| -> Result<Space> {
            let device = if p.starts_with("/big") { 1 } else { 2 };
            Ok(Space { free: if device == 1 { 1000 } else { 300 }, total: 2000, device })
        };
        let one = [need("to download", "/big/hf", 600), need("for the packed store", "/big/stores", 300)];
        let ok = check_with(&one, fs, HINT).unwrap();
        assert!(ok.starts_with("needs about 900 B (600 B to download in /big/hf, 300 B for the packed store in /big/stores); 1000 B free"), "{ok}");
        let too_much = [need("to download", "/big/hf", 600), need("for the packed store", "/big/stores", 500)];
        let e = check_with(&too_much, fs, "Free some.").unwrap_err().to_string();
        assert!(e.contains("needs about 1.07 KiB") && e.contains("has 1000 B free, 100 B short. Free some."), "{e}");
        let split = [need("to download", "/big/hf", 600), need("for the packed store", "/small/stores", 301)];
        let e = check_with(&split, fs, HINT).unwrap_err().to_string();
        assert!(e.contains("the file system of /small/stores has 300 B free, 1 B short"), "{e}");
        let split = [need("to download", "/big/hf", 600), need("for the packed store", "/small/stores", 200)];
        assert!(
            check_with(&split, fs, HINT).unwrap().ends_with("1000 B free for /big/hf, 300 B free for /small/stores")
        );
        assert!(store_estimate(1 << 30, true) > store_estimate(1 << 30, false));
    }
}
