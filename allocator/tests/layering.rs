//! The allocator's modules form layers: no module may reach, through its
//! `crate::` paths, a module that reaches it back. A cycle means two
//! concerns cannot be read or changed apart, so this test reads the
//! sources of `allocator/src` and fails on any cycle between its modules.
//!
//! A module is a file (`x.rs` or `x/mod.rs` is `x`; `x/y.rs` belongs to
//! `x`). A reference is any `crate::name` outside comments, `use
//! crate::{a, b}` groups included; a name that the crate root re-exports
//! (`crate::MemPool`) counts as a reference to the module it comes from.
//! `TIDEPOOL_LAYERING_SRC` points the check at another source tree (to
//! run it on an older checkout).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Source text without `//` comments (doc comments included: their
/// `crate::` links are documentation, not dependencies).
fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        let mut in_str = false;
        let mut prev = '\0';
        let mut cut = line.len();
        for (i, c) in line.char_indices() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
            }
            if !in_str && c == '/' && prev == '/' {
                cut = i - 1;
                break;
            }
            prev = c;
        }
        out.push_str(&line[..cut]);
        out.push('\n');
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The first path segments after each `crate::` in `code`.
fn crate_refs(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(is_ident) {
            continue; // e.g. `tidepool_crate::` (not ours)
        }
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a, b::c, d::{e, f}}`: the first segment of each item.
            let mut depth = 0usize;
            let mut item_start = true;
            let mut name = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        item_start = true;
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 && item_start {
                    if is_ident(c) {
                        name.push(c);
                        continue;
                    }
                    if !name.is_empty() {
                        out.insert(std::mem::take(&mut name));
                        item_start = false;
                    }
                }
            }
            if !name.is_empty() {
                out.insert(name);
            }
        } else {
            let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// The names the crate root re-exports (`pub use m::{A, B}` / `pub use
/// m::A`), with the module each comes from.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let code = strip_comments(lib);
    for stmt in code.split(';') {
        let stmt = stmt.trim();
        let Some(path) = stmt
            .rsplit_once("pub use ")
            .map(|(_, p)| p.trim())
            .filter(|_| stmt.contains("pub use "))
        else {
            continue;
        };
        let Some((module, names)) = path.split_once("::") else {
            continue;
        };
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for n in names.split(',') {
            let n = n.trim();
            if !n.is_empty() && n.chars().all(is_ident) {
                out.insert(n.to_string(), module.trim().to_string());
            }
        }
    }
    out
}

/// The module graph of a source tree given as (path relative to `src`,
/// text): module -> modules it refers to (itself and the root excluded).
fn graph(files: &[(PathBuf, String)]) -> BTreeMap<String, BTreeSet<String>> {
    let module_of = |p: &Path| -> Option<String> {
        let first = p.components().next()?.as_os_str().to_str()?.to_string();
        let m = first.strip_suffix(".rs").unwrap_or(&first).to_string();
        (m != "lib" && m != "main").then_some(m)
    };
    let modules: BTreeSet<String> = files.iter().filter_map(|(p, _)| module_of(p)).collect();
    let reexports = files
        .iter()
        .find(|(p, _)| p == Path::new("lib.rs"))
        .map(|(_, s)| root_reexports(s))
        .unwrap_or_default();
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (p, src) in files {
        let Some(from) = module_of(p) else { continue };
        let deps = g.entry(from.clone()).or_default();
        for name in crate_refs(&strip_comments(src)) {
            let to = if modules.contains(&name) {
                Some(name)
            } else {
                reexports.get(&name).cloned()
            };
            if let Some(to) = to.filter(|t| *t != from && modules.contains(t)) {
                deps.insert(to);
            }
        }
    }
    g
}

/// One cycle of the graph as a path `a -> b -> ... -> a`, if any.
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // 0 = unvisited, 1 = on the stack, 2 = done.
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|s| s == m).expect("on the stack");
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn read_tree(root: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("source directory is readable") {
            let path = e.expect("directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&path).expect("source file is readable");
                out.push((path.strip_prefix(root).unwrap().to_path_buf(), text));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn no_import_cycle_between_allocator_modules() {
    let root = std::env::var_os("TIDEPOOL_LAYERING_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let files = read_tree(&root);
    let g = graph(&files);
    // The check reads what it should: the pool module exists and refers to
    // the layers below it.
    assert!(
        g.get("pool").is_some_and(|d| d.len() >= 3),
        "module graph misread: {g:?}"
    );
    if let Some(cycle) = find_cycle(&g) {
        panic!(
            "import cycle between modules of {}: {}\nmodule graph: {g:#?}",
            root.display(),
            cycle.join(" -> ")
        );
    }
}

#[test]
fn the_check_sees_cycles_groups_and_reexports() {
    let file = |p: &str, s: &str| (PathBuf::from(p), s.to_string());
    let files = vec![
        file(
            "lib.rs",
            "mod a;\nmod b;\nmod c;\npub use c::{Thing, Other};\n",
        ),
        file(
            "a.rs",
            "use crate::{b::X, sync};\n// crate::c is only a comment\n",
        ),
        file("b.rs", "fn f() -> crate::Thing { todo!() }\n"),
        file("c.rs", "/// [`crate::a`] in a doc link\nstruct Thing;\n"),
        file("sync.rs", ""),
    ];
    let g = graph(&files);
    assert_eq!(
        g["a"],
        BTreeSet::from(["b".to_string(), "sync".to_string()])
    );
    assert_eq!(g["b"], BTreeSet::from(["c".to_string()]));
    assert!(g["c"].is_empty(), "doc links are not dependencies");
    assert_eq!(find_cycle(&g), None);
    // c -> a closes a -> b -> c -> a.
    let mut files = files;
    files[3] = file("c.rs", "use crate::a::Y;\nstruct Thing;\n");
    let cycle = find_cycle(&graph(&files)).expect("the cycle is found");
    assert_eq!(cycle.first(), cycle.last());
    assert_eq!(cycle.len(), 4, "{cycle:?}");
    // A submodule file belongs to its parent module.
    let files = vec![
        file("lib.rs", ""),
        file("x/mod.rs", "use crate::y::Z;\n"),
        file("x/inner.rs", ""),
        file("y.rs", "use crate::x::inner::W;\n"),
    ];
    let cycle = find_cycle(&graph(&files)).expect("x <-> y");
    assert_eq!(cycle.len(), 3, "{cycle:?}");
}
