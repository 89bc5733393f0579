//! The top-level modules of `src/` in their declared layer order, and a check that every
//! import points down it: a module may name (`crate::…`) only modules listed before it. An
//! import cycle is then impossible, and a new module must be given its place here.
//! docs/architecture.md describes the layers.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Bottom first. A module imports only modules listed above it.
const LAYERS: &[&str] = &[
    // Runtime helpers every layer may use.
    "error",
    "runtime",
    // Wire types and clients with no memory in them.
    "openai",
    "upstream",
    "telemetry",
    // The pure memory engine: no I/O, no clock.
    "memory",
    // Storage, and the hot path's cache of what it read.
    "store",
    "cache",
    // The proxy: identity, limits, the summarizer, recorder, hot path, worker.
    "credentials",
    "ratelimit",
    "summarizer",
    "recorder",
    "pipeline",
    "worker",
    // Operations and wiring.
    "metrics",
    "config",
    "cli",
    "admin",
    "server",
    "app",
    // Development tools.
    "mock",
    "eval",
];

#[test]
fn imports_point_down_the_declared_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let imports = top_level_imports(&src);
    let rank = |module: &str| LAYERS.iter().position(|layer| *layer == module);

    let mut problems = Vec::new();
    for module in imports.keys() {
        if rank(module).is_none() {
            problems.push(format!(
                "`{module}` is not in LAYERS (tests/layers.rs): give it its place"
            ));
        }
    }
    for layer in LAYERS {
        if !imports.contains_key(*layer) {
            problems.push(format!("LAYERS names `{layer}`, which src/ does not have"));
        }
    }
    for (module, uses) in &imports {
        let Some(own) = rank(module) else { continue };
        for (used, files) in uses {
            if rank(used).is_some_and(|theirs| theirs > own) {
                problems.push(format!(
                    "`{module}` imports `{used}`, a layer above it, in {}",
                    files.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The checker's own parsing, on the shapes imports take.
#[test]
fn finds_paths_groups_and_skips_comments_and_tests() {
    let code = "use crate::store::{Job, UserKey};\n\
                use crate::{memory::{self, MemoryState}, openai};\n\
                // crate::admin in a comment\n\
                fn f() { crate::runtime::now_micros(); }\n\
                #[cfg(test)]\nmod tests {\n    use crate::app::Engram;\n    fn g() { let _ = (\"{\", '{', '\\'', \"\\\"{\"); }\n}\n\
                fn after() { crate::cache::first_version(); }\n";
    let found = imported_modules(code);
    let expected: BTreeSet<String> = ["store", "memory", "openai", "runtime", "cache"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(found, expected);
}

/// Top-level module → (module it imports → the files that do).
fn top_level_imports(src: &Path) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut imports: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for file in rust_files(src) {
        let relative = file.strip_prefix(src).unwrap_or(&file).to_path_buf();
        let first = relative
            .components()
            .next()
            .map(|part| part.as_os_str().to_string_lossy().into_owned())
            .unwrap_or_default();
        let module = first.strip_suffix(".rs").unwrap_or(&first).to_owned();
        if module == "lib" || module == "main" {
            continue;
        }
        let code = std::fs::read_to_string(&file).unwrap();
        let uses = imports.entry(module.clone()).or_default();
        for used in imported_modules(&code) {
            if used != module {
                uses.entry(used)
                    .or_default()
                    .insert(relative.display().to_string());
            }
        }
    }
    imports
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// The top-level modules `code` names through `crate::`, outside comments and test modules.
fn imported_modules(code: &str) -> BTreeSet<String> {
    let code = without_test_modules(&without_comments(code));
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `engram_crate::`, not ours
        }
        if let Some(group) = rest.strip_prefix('{') {
            found.extend(group_heads(group));
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

/// The first segment of each path in a `{a::b, c, d::{e, f}}` group (after its `{`).
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut at_start = true;
    let mut name = String::new();
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => at_start = true,
            c if at_start && (c.is_alphanumeric() || c == '_') => name.push(c),
            c if at_start && (!c.is_whitespace() || !name.is_empty()) => {
                if !name.is_empty() {
                    heads.push(std::mem::take(&mut name));
                }
                at_start = false;
            }
            _ => {}
        }
    }
    if !name.is_empty() {
        heads.push(name);
    }
    heads.retain(|head| head != "self");
    heads
}

/// `code` without `//` comments (a `//` inside a string, as in a URL, ends the line early:
/// what follows it on that line is not read).
fn without_comments(code: &str) -> String {
    code.lines()
        .map(|line| line.find("//").map_or(line, |at| &line[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `code` without its `#[cfg(test)]` items (test modules may use any layer).
fn without_test_modules(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        // The item ends at its `;` or at the brace closing its first `{`; braces inside
        // string and character literals do not count.
        let mut depth = 0usize;
        let mut end = item.len();
        let mut chars = item.char_indices().peekable();
        while let Some((index, c)) = chars.next() {
            match c {
                '"' => skip_string(&mut chars),
                '\'' => skip_char_literal(&mut chars),
                ';' if depth == 0 => {
                    end = index + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = index + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

type Chars<'a> = std::iter::Peekable<std::str::CharIndices<'a>>;

/// Past the end of a string literal whose opening `"` was just read.
fn skip_string(chars: &mut Chars) {
    while let Some((_, c)) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '"' => return,
            _ => {}
        }
    }
}

/// Past a character literal (`'{'`, `'\''`) whose `'` was just read; a lifetime (`'a`) is
/// left as it is.
fn skip_char_literal(chars: &mut Chars) {
    let mut ahead = chars.clone();
    let literal_len = match ahead.next() {
        Some((_, '\\')) => {
            ahead.next();
            ahead.position(|(_, c)| c == '\'').map(|at| at + 2)
        }
        Some(_) => matches!(ahead.next(), Some((_, '\''))).then_some(1),
        None => None,
    };
    if let Some(len) = literal_len {
        for _ in 0..=len {
            chars.next();
        }
    }
}
