//! The workspace's crates and each crate's top-level modules in their declared layer order,
//! and checks that every dependency and import points down it: a crate depends (normal
//! dependencies) only on crates listed before it, and a module may name (`crate::…`, or
//! `super::…` from a top-level file) only modules of its own layer or of layers listed before
//! it. A cycle is then impossible (a dev-dependency may point up, to a development tool, but
//! may not close a cycle), and a new crate or module must be given its place here. The
//! sidecar's dependency tree is checked for the development tools and test frameworks, the
//! engine's for an async runtime or I/O, the store's for HTTP, the telemetry SDK and metrics,
//! the proxy's for the trace exporter and the command line and configuration file parsers.
//! docs/architecture.md describes the layers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// A crate of the workspace: its package name, its directory from the workspace root, and its
/// top-level modules in layers, bottom first. Modules of one layer may import each other.
struct Crate {
    name: &'static str,
    dir: &'static str,
    layers: &'static [&'static [&'static str]],
    /// Names that stand for a crate below, not a module of this one (`use engram_memory as
    /// memory`), and the crate they stand for.
    aliases: &'static [(&'static str, &'static str)],
}

/// Bottom first. A crate depends only on crates listed above it.
const CRATES: &[Crate] = &[
    // The pure memory engine and what it needs below it: no tokio, clock or I/O.
    Crate {
        name: "engram-memory",
        dir: "crates/engram-memory",
        layers: &[
            &["error"],
            // The update path's yield points.
            &["yielding"],
            // Wire types with no memory in them.
            &["openai"],
            // The engine's folders: its settings; words, tokens and fences in text; the
            // memory's data; the lexical index and scores; composing the prompt; recording an
            // exchange (which renders and links what it records as the prompt would); the
            // admin views.
            &["config"],
            &["tokenize"],
            &["state"],
            &["retrieval"],
            &["prompt"],
            &["update"],
            &["manage"],
        ],
        aliases: &[],
    },
    // What every layer of the sidecar stands on: the one error type, then the runtime helpers
    // (boxed future and clock in its root, the update path's runtimes and thread priorities).
    Crate {
        name: "engram-runtime",
        dir: "crates/engram-runtime",
        layers: &[&["error"], &["priority"]],
        aliases: &[],
    },
    // Storage: the store traits (its root) and their backends.
    Crate {
        name: "engram-store",
        dir: "crates/engram-store",
        layers: &[
            // What a job keeps of its request's trace; the stored layout of a memory.
            &["trace"],
            &["layout"],
            // The embedded store's database handle, group commit and intake log.
            &["db_handle"],
            &["group_commit", "intake"],
            // The backends.
            &["embedded", "redis"],
        ],
        aliases: &[],
    },
    // The proxy: everything a request and its recording go through.
    Crate {
        name: "engram-proxy",
        dir: "crates/engram-proxy",
        layers: &[
            // Tests only: a store for the recorder's and the hot path's tests.
            &["test_store"],
            // Clients with no memory in them.
            &["upstream"],
            &["telemetry"],
            // The hot path's cache of what it read from the store.
            &["cache"],
            // Identity, limits, the summarizer, recorder, hot path, worker.
            &["credentials"],
            &["ratelimit"],
            &["summarizer"],
            &["recorder"],
            &["pipeline"],
            &["worker"],
        ],
        aliases: &[
            // `use engram_runtime::error` in its lib.rs: the sidecar's error type.
            ("error", "engram-runtime"),
        ],
    },
    // Operations: metrics, configuration, command line, management API.
    Crate {
        name: "engram-ops",
        dir: "crates/engram-ops",
        layers: &[
            // The OTLP exporter behind the proxy's tracing handle; the metrics registry.
            &["telemetry"],
            &["metrics"],
            &["config"],
            &["cli"],
            &["admin"],
        ],
        aliases: &[
            // `use engram_runtime::error` in its lib.rs: the sidecar's error type.
            ("error", "engram-runtime"),
        ],
    },
    // The sidecar: HTTP and wiring, its library and the `engram` binary.
    Crate {
        name: "engram",
        dir: ".",
        layers: &[&["server"], &["app"]],
        aliases: &[
            // `pub use engram_runtime::error` in src/lib.rs: the sidecar's error type.
            ("error", "engram-runtime"),
        ],
    },
    // Development tools, outside the sidecar.
    Crate {
        name: "engram-mock",
        dir: "crates/engram-mock",
        layers: &[&["cli"]],
        aliases: &[],
    },
    Crate {
        name: "engram-eval",
        dir: "crates/engram-eval",
        layers: &[
            // The data, the figures and the baselines.
            &["dataset", "bm25", "metrics", "progress"],
            &["baselines"],
            // The harness's clients and its scripted upstream.
            &["client", "upstream"],
            // The replay and its report (they import each other), the chart of the report.
            &["locomo", "report", "chart"],
            &["cli"],
        ],
        aliases: &[],
    },
];

/// What the sidecar's dependency tree (normal dependencies) must not hold.
const NOT_IN_THE_SIDECAR: &[&str] = &["engram-mock", "engram-eval", "criterion", "proptest"];

/// What the engine's dependency tree must not hold: an async runtime, sockets, storage.
const NOT_IN_THE_ENGINE: &[&str] = &[
    "tokio",
    "mio",
    "socket2",
    "hyper",
    "redb",
    "redis",
    "thread-priority",
];

/// What the store's dependency tree must not hold: an HTTP client or server, the telemetry SDK
/// (a job keeps its trace parent through OpenTelemetry's API only), the metrics registry.
const NOT_IN_THE_STORE: &[&str] = &["hyper", "opentelemetry_sdk", "prometheus"];

/// What the proxy's dependency tree must not hold: the trace exporter and its protobuf stack
/// (the proxy keeps the spans and their propagation; operations export them), and the
/// command line's and configuration file's parsers. (It keeps the telemetry SDK, whose tracer,
/// spans and W3C propagator it uses, and prometheus, whose handles its modules count into.)
const NOT_IN_THE_PROXY: &[&str] = &["opentelemetry-otlp", "prost", "clap", "serde-saphyr"];

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rank_of(name: &str) -> Option<usize> {
    CRATES.iter().position(|krate| krate.name == name)
}

#[test]
fn imports_point_down_the_declared_layers() {
    let mut problems = Vec::new();
    for krate in CRATES {
        problems.extend(module_problems(krate));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The problems of one crate's modules: a module not in its layers (or a layer naming a
/// module the crate does not have), an import of a module in a layer above.
fn module_problems(krate: &Crate) -> Vec<String> {
    let src = workspace_root().join(krate.dir).join("src");
    let modules = top_level_modules(&src);
    let imports = top_level_imports(&src, &modules);
    let rank = |module: &str| {
        krate
            .layers
            .iter()
            .position(|layer| layer.contains(&module))
    };
    let name = krate.name;
    let mut problems = Vec::new();
    for module in &modules {
        if rank(module).is_none() {
            problems.push(format!(
                "`{name}::{module}` has no layer in CRATES (tests/layers.rs): give it its place"
            ));
        }
    }
    for module in krate.layers.iter().flat_map(|layer| layer.iter()) {
        if !modules.contains(*module) {
            problems.push(format!(
                "CRATES names `{name}::{module}`, which its src/ does not have"
            ));
        }
    }
    for (alias, below) in krate.aliases {
        if rank_of(below) >= rank_of(name) {
            problems.push(format!(
                "`{name}` names `{alias}` for `{below}`, not a crate below it"
            ));
        }
    }
    for (module, uses) in &imports {
        let Some(own) = rank(module) else { continue };
        for (used, files) in uses {
            if rank(used).is_some_and(|theirs| theirs > own) {
                problems.push(format!(
                    "`{name}::{module}` imports `{used}`, a layer above it, in {}",
                    files.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    problems
}

/// The crates' dependencies point down [`CRATES`], and no dependency of any kind closes a
/// cycle.
#[test]
fn crates_depend_down_the_declared_order() {
    let metadata = cargo_metadata();
    let problems = crate_problems(&workspace_dependencies(&metadata));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The checker fails on a crate depending up, and on a cycle through a dev-dependency.
#[test]
fn the_crate_check_fails_on_an_upward_dependency_and_a_cycle() {
    let edge = |from: &str, to: &str, kind: &str| (from.to_owned(), to.to_owned(), kind.to_owned());
    let sound = vec![
        edge("engram", "engram-memory", "normal"),
        edge("engram", "engram-mock", "dev"),
        edge("engram-eval", "engram", "normal"),
    ];
    assert!(crate_problems(&as_graph(&sound)).is_empty());
    let mut upward = sound.clone();
    upward.push(edge("engram-memory", "engram", "normal"));
    assert!(
        crate_problems(&as_graph(&upward))
            .iter()
            .any(|problem| problem.contains("a crate above it")),
        "{:?}",
        crate_problems(&as_graph(&upward))
    );
    let mut cycle = sound;
    cycle.push(edge("engram", "engram-eval", "dev"));
    assert!(
        crate_problems(&as_graph(&cycle))
            .iter()
            .any(|problem| problem.contains("cycle")),
        "{:?}",
        crate_problems(&as_graph(&cycle))
    );
}

type Graph = BTreeMap<String, Vec<(String, String)>>;

fn as_graph(edges: &[(String, String, String)]) -> Graph {
    let mut graph: Graph = CRATES
        .iter()
        .map(|krate| (krate.name.to_owned(), Vec::new()))
        .collect();
    for (from, to, kind) in edges {
        graph
            .entry(from.clone())
            .or_default()
            .push((to.clone(), kind.clone()));
    }
    graph
}

/// Workspace crate → (workspace crate it depends on, `normal`, `dev` or `build`).
fn workspace_dependencies(metadata: &Value) -> Graph {
    let members: BTreeSet<&str> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|package| package["name"].as_str().unwrap())
        .collect();
    let mut graph = Graph::new();
    for package in metadata["packages"].as_array().unwrap() {
        let edges = graph
            .entry(package["name"].as_str().unwrap().to_owned())
            .or_default();
        for dependency in package["dependencies"].as_array().unwrap() {
            let name = dependency["name"].as_str().unwrap();
            if members.contains(name) {
                let kind = dependency["kind"].as_str().unwrap_or("normal");
                edges.push((name.to_owned(), kind.to_owned()));
            }
        }
    }
    graph
}

fn crate_problems(graph: &Graph) -> Vec<String> {
    let mut problems = Vec::new();
    for name in graph.keys() {
        if rank_of(name).is_none() {
            problems.push(format!(
                "crate `{name}` is not in CRATES (tests/layers.rs): give it its place"
            ));
        }
    }
    for krate in CRATES {
        if !graph.contains_key(krate.name) {
            problems.push(format!(
                "CRATES names `{}`, which the workspace does not have",
                krate.name
            ));
        }
    }
    for (name, edges) in graph {
        for (used, kind) in edges {
            if kind != "dev" && rank_of(used) > rank_of(name) {
                problems.push(format!(
                    "`{name}` depends on `{used}`, a crate above it ({kind})"
                ));
            }
        }
    }
    // Depth-first search over every kind of dependency.
    fn visit(
        name: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        problems: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|seen| seen == name) {
            problems.push(format!(
                "a dependency cycle: {} → {name}",
                path[at..].join(" → ")
            ));
            return;
        }
        if !done.insert(name.to_owned()) {
            return;
        }
        path.push(name.to_owned());
        for (used, _) in graph.get(name).into_iter().flatten() {
            visit(used, graph, path, done, problems);
        }
        path.pop();
    }
    let mut done = BTreeSet::new();
    for name in graph.keys() {
        visit(name, graph, &mut Vec::new(), &mut done, &mut problems);
    }
    problems
}

/// The sidecar's normal dependency tree holds no development tool or test framework, the
/// engine's no async runtime or I/O, the store's no HTTP, telemetry SDK or metrics, the proxy's
/// no trace exporter or command line and configuration file parsers.
#[test]
fn the_sidecar_engine_store_and_proxy_trees_hold_nothing_they_must_not() {
    let sidecar = dependency_tree("engram");
    let engine = dependency_tree("engram-memory");
    let store = dependency_tree("engram-store");
    let proxy = dependency_tree("engram-proxy");
    assert!(proxy.contains("engram-store"), "{proxy:?}");
    assert!(sidecar.contains("engram-memory"), "{sidecar:?}");
    let mut problems = Vec::new();
    for name in NOT_IN_THE_SIDECAR {
        if sidecar.contains(*name) {
            problems.push(format!("`cargo tree -p engram -e normal` holds {name}"));
        }
    }
    for name in NOT_IN_THE_ENGINE {
        if engine.contains(*name) {
            problems.push(format!(
                "`cargo tree -p engram-memory -e normal` holds {name}"
            ));
        }
    }
    for name in NOT_IN_THE_STORE {
        if store.contains(*name) {
            problems.push(format!(
                "`cargo tree -p engram-store -e normal` holds {name}"
            ));
        }
    }
    for name in NOT_IN_THE_PROXY {
        if proxy.contains(*name) {
            problems.push(format!(
                "`cargo tree -p engram-proxy -e normal` holds {name}"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

fn cargo() -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.current_dir(workspace_root());
    command
}

fn cargo_metadata() -> Value {
    let output = cargo()
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .output()
        .expect("run cargo metadata");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The package names in `package`'s tree of normal dependencies.
fn dependency_tree(package: &str) -> BTreeSet<String> {
    let output = cargo()
        .args([
            "tree",
            "--offline",
            "-p",
            package,
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["--format", "{p}"])
        .output()
        .expect("run cargo tree");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// The checker's own parsing, on the shapes imports take.
#[test]
fn finds_paths_groups_and_skips_comments_and_tests() {
    let code = "use crate::store::{Job, UserKey};\n\
                use crate::{memory::{self, MemoryState}, openai};\n\
                use crate::{pipeline, worker};\n\
                // crate::admin in a comment\n\
                fn f() { crate::runtime::now_micros(); }\n\
                #[cfg(test)]\nmod tests {\n    use crate::app::Engram;\n    fn g() { let _ = (\"{\", '{', '\\'', \"\\\"{\"); }\n}\n\
                fn after() { crate::cache::first_version(); }\n";
    let found = imported_modules(code);
    let expected: BTreeSet<String> = [
        "store", "memory", "openai", "pipeline", "worker", "runtime", "cache",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(found, expected);
}

/// Braces and quotes inside raw strings do not end a test module early, nor keep it open.
#[test]
fn raw_strings_in_test_modules_are_skipped() {
    let code = "#[cfg(test)]\nmod tests {\n    use crate::app::Engram;\n    \
                const A: &str = r#\"a \"}\" quote\"#;\n    const B: &str = r\"{\";\n    \
                fn r#type() { crate::admin::x(); }\n}\n\
                fn after() { crate::cache::first_version(); }\n";
    let found = imported_modules(code);
    let expected: BTreeSet<String> = ["cache"].into_iter().map(String::from).collect();
    assert_eq!(found, expected);
}

/// The checker's reading of `lib.rs` re-exports and of test modules kept in files of their own.
#[test]
fn reads_reexports_and_finds_test_module_files() {
    let modules: BTreeSet<String> = ["state", "prompt"].into_iter().map(String::from).collect();
    let lib = "pub mod state;\n// pub use prompt::hidden;\n\
               pub use render::{Fixed, warm_up_fixed};\n\
               pub use state::{memo, model};\npub use prompt::render;\n\
               pub use model::MemoryState;\npub use serde::Deserialize;\n";
    let found = reexported_modules(lib, &modules);
    let expected: BTreeMap<String, String> = [
        ("memo", "state"),
        ("model", "state"),
        ("MemoryState", "state"),
        ("render", "prompt"),
        ("Fixed", "prompt"),
        ("warm_up_fixed", "prompt"),
    ]
    .into_iter()
    .map(|(name, module)| (name.to_owned(), module.to_owned()))
    .collect();
    assert_eq!(found, expected);

    let dir = std::env::temp_dir().join(format!("engram-layers-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("compose")).unwrap();
    let parent = dir.join("compose").join("mod.rs");
    std::fs::write(
        &parent,
        "mod window;\n#[cfg(test)]\nmod tests;\n#[cfg(test)]\nmod inline {}\n",
    )
    .unwrap();
    let leaf = dir.join("render.rs");
    std::fs::write(&leaf, "#[cfg(test)]\nmod tests;\n").unwrap();
    let tests = test_module_files(&[parent, leaf]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(tests.contains(&dir.join("compose").join("tests.rs")));
    assert!(tests.contains(&dir.join("render").join("tests.rs")));
    assert!(!tests.contains(&dir.join("compose").join("window.rs")));
    assert!(!tests.contains(&dir.join("compose").join("inline.rs")));
}

/// The crate's top-level modules: the files and folders of its `src/` but `lib.rs` and
/// `main.rs`.
fn top_level_modules(src: &Path) -> BTreeSet<String> {
    std::fs::read_dir(src)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_dir() || path.extension().is_some_and(|ext| ext == "rs"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|name| name != "lib" && name != "main")
        .collect()
}

/// Top-level module → (module of the crate it imports → the files that do). A name `lib.rs`
/// re-exports from a top-level module (`pub use state::{model, memo}`) counts as that module;
/// files that are test modules (`#[cfg(test)] mod tests;`) are not read.
fn top_level_imports(
    src: &Path,
    modules: &BTreeSet<String>,
) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap_or_default();
    let reexported = reexported_modules(&lib, modules);
    let files = rust_files(src);
    let tests = test_module_files(&files);
    let mut imports: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for file in files.iter().filter(|file| !tests.contains(*file)) {
        let relative = file.strip_prefix(src).unwrap_or(file).to_path_buf();
        let first = relative
            .components()
            .next()
            .map(|part| part.as_os_str().to_string_lossy().into_owned())
            .unwrap_or_default();
        let module = first.strip_suffix(".rs").unwrap_or(&first).to_owned();
        if module == "lib" || module == "main" {
            continue;
        }
        let mut code = std::fs::read_to_string(file).unwrap();
        // In `src/x.rs` and `src/x/mod.rs`, `super::` is the crate root.
        let top_file = relative.components().count() == 1
            || relative.ends_with("mod.rs") && relative.components().count() == 2;
        if top_file {
            code = code.replace("super::", "crate::");
        }
        let uses = imports.entry(module.clone()).or_default();
        for used in imported_modules(&code) {
            let used = reexported.get(&used).cloned().unwrap_or(used);
            if used != module && modules.contains(&used) {
                uses.entry(used)
                    .or_default()
                    .insert(relative.display().to_string());
            }
        }
    }
    imports
}

/// The names `lib` re-exports from a top-level module, and that module: `pub use state::{model,
/// memo};` gives `model` and `memo` → `state`, and then `pub use model::MemoryState;` gives
/// `MemoryState` → `state` too, so `crate::MemoryState` counts as an import of `state`.
fn reexported_modules(lib: &str, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let code = without_comments(lib);
    let mut found: BTreeMap<String, String> = BTreeMap::new();
    // Twice, so a name re-exported from a re-exported module resolves wherever its line is.
    for _ in 0..2 {
        for statement in code.split(';') {
            let Some(path) = statement.trim().strip_prefix("pub use ") else {
                continue;
            };
            let Some((head, names)) = path.split_once("::") else {
                continue;
            };
            let head = head.trim();
            let module = if modules.contains(head) {
                head.to_owned()
            } else if let Some(module) = found.get(head) {
                module.clone()
            } else {
                continue;
            };
            let names = names.trim();
            let names = match names.strip_prefix('{') {
                Some(group) => group_heads(group),
                None => names
                    .rsplit("::")
                    .next()
                    .map(str::to_owned)
                    .into_iter()
                    .collect(),
            };
            for name in names {
                found.insert(name, module.clone());
            }
        }
    }
    found
}

/// The files among `files` that some file declares as a test module (`#[cfg(test)]` then
/// `mod name;`): `name.rs` or `name/mod.rs` beside a `mod.rs` or `lib.rs`, under a folder named
/// after any other file.
fn test_module_files(files: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut tests = BTreeSet::new();
    for file in files {
        let code = without_comments(&std::fs::read_to_string(file).unwrap());
        let mut rest = code.as_str();
        while let Some(at) = rest.find("#[cfg(test)]") {
            rest = &rest[at + "#[cfg(test)]".len()..];
            let item = rest.trim_start();
            let item = item.strip_prefix("pub(crate) ").unwrap_or(item);
            let Some(declared) = item.strip_prefix("mod ") else {
                continue;
            };
            let name: String = declared
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() || !declared[name.len()..].trim_start().starts_with(';') {
                continue;
            }
            let dir = file.parent().unwrap_or(Path::new(""));
            let stem = file.file_stem().unwrap_or_default();
            let base = if stem == "mod" || stem == "lib" || stem == "main" {
                dir.to_path_buf()
            } else {
                dir.join(stem)
            };
            tests.insert(base.join(format!("{name}.rs")));
            tests.insert(base.join(name).join("mod.rs"));
        }
    }
    tests
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
            ',' if depth == 0 => {
                if !name.is_empty() {
                    heads.push(std::mem::take(&mut name));
                }
                at_start = true;
            }
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
                'r' => skip_raw_string(&mut chars),
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

/// Past a raw string literal (`r"{"`, `r#"say "}""#`) whose `r` was just read; anything else
/// (an identifier's `r`, a raw identifier `r#type`) is left as it is.
fn skip_raw_string(chars: &mut Chars) {
    let mut ahead = chars.clone();
    let mut hashes = 0;
    let opens = loop {
        match ahead.next() {
            Some((_, '#')) => hashes += 1,
            Some((_, '"')) => break true,
            _ => break false,
        }
    };
    if !opens {
        return;
    }
    *chars = ahead;
    while let Some((_, c)) = chars.next() {
        if c == '"' {
            let mut closing = chars.clone();
            if (0..hashes).all(|_| matches!(closing.next(), Some((_, '#')))) {
                *chars = closing;
                return;
            }
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
