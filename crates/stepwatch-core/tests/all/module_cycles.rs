//! The core's modules form no import cycle: each depends only on modules
//! below it, so one can be read, tested and moved without the rest.
//!
//! Read from the source: every `crate::<module>` path outside comments and
//! test code, between top-level modules (`src/x.rs` or `src/x/`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeMap<String, String>>;

#[test]
fn the_core_modules_import_each_other_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = Graph::new();
    read_dir(&src, &src, &mut graph);
    assert!(graph.len() > 10, "read only {:?}", graph.keys());
    if let Some(cycle) = find_cycle(&graph) {
        let edges: Vec<String> = cycle
            .windows(2)
            .map(|w| format!("{} -> {} ({})", w[0], w[1], graph[&w[0]][&w[1]]))
            .collect();
        panic!("import cycle in stepwatch-core:\n  {}", edges.join("\n  "));
    }
}

fn read_dir(src: &Path, dir: &Path, graph: &mut Graph) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            read_dir(src, &path, graph);
            continue;
        }
        let relative = path.strip_prefix(src).unwrap();
        let name = path.file_name().unwrap().to_str().unwrap();
        if path.extension().is_none_or(|e| e != "rs") || name == "lib.rs" || name == "tests.rs" {
            continue;
        }
        let first = relative.components().next().unwrap().as_os_str();
        let module = first.to_str().unwrap().trim_end_matches(".rs").to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        let imports = graph.entry(module.clone()).or_default();
        for (number, line) in code_lines(&text) {
            for target in line.split("crate::").skip(1).map(leading_ident) {
                if !target.is_empty() && target != module {
                    let at = format!("{}:{number}", relative.display());
                    imports.entry(target.to_string()).or_insert(at);
                }
            }
        }
    }
}

/// Lines of code before the file's test module, comments left out.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .take_while(|(_, l)| l.trim() != "#[cfg(test)]")
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, l.split("//").next().unwrap_or(l)))
}

fn leading_ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// A cycle as its modules, the first repeated at the end.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        graph: &Graph,
        module: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == module) {
            let mut cycle = path[at..].to_vec();
            cycle.push(module.to_string());
            return Some(cycle);
        }
        if done.contains(module) {
            return None;
        }
        path.push(module.to_string());
        for target in graph.get(module).into_iter().flat_map(|t| t.keys()) {
            if let Some(cycle) = visit(graph, target, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(module.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(graph, m, &mut Vec::new(), &mut done))
}
