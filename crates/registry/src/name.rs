//! What a model name may be: it becomes a directory name under `stores/` and a CLI argument.

use anyhow::{Result, bail};

/// Longest name accepted (a directory name, with room for the `.tmp-` prefix and a pid).
const MAX_LEN: usize = 200;

/// Accepts ASCII letters, digits, `-`, `_` and `.`, not starting with `.` (hidden and `..`).
pub fn validate_name(name: &str) -> Result<()> {
    if name.is_empty() {
        bail!("a model name cannot be empty");
    }
    if name.len() > MAX_LEN {
        bail!("model name {name:?} is {} characters long; the limit is {MAX_LEN}", name.len());
    }
    if name.starts_with('.') {
        bail!("model name {name:?} cannot start with '.'");
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
        bail!("model name {name:?} contains {c:?}; use letters, digits, '-', '_' and '.'");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_and_rejects() {
        for ok in ["flash", "Qwen3.8-Flash_4bit", "a", "x.y-z_1"] {
            validate_name(ok).unwrap();
        }
        for (bad, why) in [
            ("", "empty"),
            (".hidden", "start with '.'"),
            ("..", "start with '.'"),
            ("a/b", "'/'"),
            ("a b", "' '"),
            ("café", "'é'"),
        ] {
            let e = validate_name(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        assert!(validate_name(&"x".repeat(201)).unwrap_err().to_string().contains("limit is 200"));
    }
}
