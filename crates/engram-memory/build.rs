//! Writes tiktoken's o200k and cl100k vocabularies as the compact tables the token counter
//! reads in place (`src/tokenize/bpe.rs`): per encoding, every ordinary token's bytes in
//! rank order (`<name>.bytes`) and where each rank starts in them (`<name>.starts`, little-endian
//! u32, one more than the ranks).
//!
//! Built from tiktoken-rs's own tables at compile time, so the proxy never builds them: built at
//! start-up they took an idle proxy's RSS to 60 MiB, most of it freed heap the allocator kept
//! (26 MiB without them; docs/benchmarks-log.md, 2026-11-27).

// Cargo reads a build script's directives from its standard output.
#![allow(clippy::print_stdout)]

use std::collections::HashSet;
use std::error::Error;
use std::path::{Path, PathBuf};

use tiktoken_rs::CoreBPE;

/// Ranks are below this in both encodings (o200k's last is 200,018).
const RANK_LIMIT: u32 = 1 << 18;

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo::rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("cargo sets OUT_DIR")?);
    write_tables(&out, "o200k", &tiktoken_rs::o200k_base()?)?;
    write_tables(&out, "cl100k", &tiktoken_rs::cl100k_base()?)?;
    Ok(())
}

fn write_tables(out: &Path, name: &str, tiktoken: &CoreBPE) -> Result<(), Box<dyn Error>> {
    let special: HashSet<&str> = tiktoken.special_tokens();
    let mut bytes = Vec::new();
    let mut starts: Vec<u32> = Vec::new();
    for rank in 0..RANK_LIMIT {
        starts.push(u32::try_from(bytes.len())?);
        if let Ok(token) = tiktoken.decode_bytes(&[rank])
            && !std::str::from_utf8(&token).is_ok_and(|text| special.contains(text))
        {
            bytes.extend_from_slice(&token);
        }
    }
    // Unused ranks past the last token are dropped.
    while starts.len() > 1 && starts.last() == starts.get(starts.len() - 2) {
        starts.pop();
    }
    starts.push(u32::try_from(bytes.len())?);
    let starts: Vec<u8> = starts
        .iter()
        .flat_map(|start| start.to_le_bytes())
        .collect();
    std::fs::write(out.join(format!("{name}.bytes")), bytes)?;
    std::fs::write(out.join(format!("{name}.starts")), starts)?;
    Ok(())
}
