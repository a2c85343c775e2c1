//! The `--html` dependency view renders in headless Chromium: one `data-task-id` node per task,
//! no script errors, and a selected task shows its edges. Needs `/usr/bin/chromium`
//! (`apt-get install -y chromium`). Without it the test says so and passes, unless
//! `SIMPLER_REQUIRE_CHROMIUM=1` (set by `.ci/run`, which installs Chromium): then it fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use simpler_core::trace::{
    ArgRecord, DepGraph, EdgeRecord, EdgeSource, OverlapKind, ScopeKindRecord, TaskNode, TensorNode,
};
use simpler_core::{DType, TaskId};
use simpler_dfx::html::to_html;

const CHROMIUM: &str = "/usr/bin/chromium";

fn chromium() -> Option<PathBuf> {
    let path =
        std::env::var_os("SIMPLER_CHROMIUM").map_or_else(|| PathBuf::from(CHROMIUM), PathBuf::from);
    if path.exists() {
        return Some(path);
    }
    let msg = format!(
        "headless Chromium is needed for this test but {} does not exist: install it with `apt-get install -y chromium` (or point SIMPLER_CHROMIUM at a Chromium binary)",
        path.display()
    );
    assert!(
        std::env::var_os("SIMPLER_REQUIRE_CHROMIUM").is_none(),
        "{msg}"
    );
    eprintln!("SKIPPED: {msg}");
    None
}

/// A DAG of `n` tasks on two rings with mixed edge sources; task 5's kernel name tries to break
/// out of the page's script.
fn graph(n: u32) -> DepGraph {
    let id = |k: u32| TaskId::new((k % 2) as u8, k).0;
    let mut edges = Vec::new();
    for k in 1..n {
        for back in [1, 3, 7] {
            if k >= back && (k + back) % 3 != 0 {
                let source = [
                    EdgeSource::Creator,
                    EdgeSource::Tensormap,
                    EdgeSource::Explicit,
                ][(k % 3) as usize];
                let overlap = if source == EdgeSource::Tensormap {
                    OverlapKind::Conservative
                } else {
                    OverlapKind::None
                };
                edges.push(EdgeRecord {
                    pred: id(k - back),
                    succ: id(k),
                    source,
                    overlap,
                });
            }
        }
    }
    DepGraph {
        v: 1,
        fingerprint: "0123456789abcdef".into(),
        tasks: (0..n)
            .map(|k| TaskNode {
                id: id(k),
                scope: if k % 5 == 0 {
                    ScopeKindRecord::Manual
                } else {
                    ScopeKindRecord::Auto
                },
                scope_depth: k % 2,
                kernel: if k == 9 { u32::MAX } else { k % 4 },
                kernel_name: if k == 5 {
                    "</script><script>throw 1</script>&amp;".into()
                } else {
                    format!("kernel_{}", k % 4)
                },
                block_num: 1 + k % 3,
                args: vec![ArgRecord {
                    tag: "input".into(),
                    tensor: 0,
                    offset: 0,
                    shape: vec![4, 8],
                    strides: vec![8, 1],
                }],
            })
            .collect(),
        tensors: vec![TensorNode {
            buffer: 1,
            version: 0,
            dtype: DType::F32,
            size: 128,
        }],
        edges,
    }
}

/// Runs headless Chromium on `url` and returns the serialised DOM after load.
fn dump_dom(chromium: &Path, dir: &Path, url: &str) -> String {
    let profile = dir.join("profile");
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromium");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut s).map(|_| s)
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within 120 s for {url}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader.join().unwrap().expect("read chromium output")
}

/// The DOM with `<script>` elements removed (their text is not rendered content).
fn without_scripts(dom: &str) -> String {
    let mut out = String::new();
    let mut rest = dom;
    while let Some(i) = rest.find("<script") {
        out.push_str(&rest[..i]);
        match rest[i..].find("</script>") {
            Some(j) => rest = &rest[i + j + "</script>".len()..],
            None => {
                rest = "";
                break;
            }
        }
    }
    out.push_str(rest);
    out
}

fn body_attr(dom: &str, attr: &str) -> Option<String> {
    let body = &dom[dom.find("<body")?..];
    let tag = &body[..body.find('>')?];
    let key = format!("{attr}=\"");
    let at = tag.find(&key)? + key.len();
    Some(tag[at..at + tag[at..].find('"')?].to_string())
}

fn task_ids(dom: &str) -> Vec<String> {
    let key = "data-task-id=\"";
    without_scripts(dom)
        .match_indices(key)
        .map(|(i, _)| {
            let s = &without_scripts(dom)[i + key.len()..];
            s[..s.find('"').unwrap()].to_string()
        })
        .collect()
}

#[test]
fn html_view_renders_one_node_per_task_without_script_errors() {
    let Some(chromium) = chromium() else { return };
    let dir = std::env::temp_dir().join(format!("simpler-dfx-chromium-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let g = graph(40);
    let page = dir.join("deps.html");
    std::fs::write(&page, to_html(&g, "test <graph>").unwrap()).unwrap();
    let url = format!("file://{}", page.display());

    let dom = dump_dom(&chromium, &dir, &url);
    assert_eq!(body_attr(&dom, "data-errors"), None, "script errors: {dom}");
    assert_eq!(
        body_attr(&dom, "data-rendered").as_deref(),
        Some("40"),
        "page did not finish rendering"
    );
    let mut ids = task_ids(&dom);
    ids.sort();
    let mut want: Vec<String> = g.tasks.iter().map(|t| t.id.to_string()).collect();
    want.sort();
    assert_eq!(ids, want, "one node per task, carrying its id");
    assert!(
        !without_scripts(&dom).contains("<script><b>"),
        "kernel name escaped the data block"
    );

    // Selecting a task highlights its edges and lists them.
    let t = &g.tasks[10];
    let preds = g.edges.iter().filter(|e| e.succ == t.id).count();
    let succs = g.edges.iter().filter(|e| e.pred == t.id).count();
    let dom = dump_dom(&chromium, &dir, &format!("{url}#task={}", t.id));
    assert_eq!(body_attr(&dom, "data-errors"), None, "script errors: {dom}");
    assert_eq!(body_attr(&dom, "data-selected"), Some(t.id.to_string()));
    assert!(
        dom.contains(&format!("in-edges (predecessors) ({preds})")),
        "{dom}"
    );
    assert!(
        dom.contains(&format!("out-edges (successors) ({succs})")),
        "{dom}"
    );
    let flagged = without_scripts(&dom)
        .matches("class=\"edge ")
        .filter(|_| true)
        .count();
    assert_eq!(flagged, g.edges.len());
    assert_eq!(dom.matches(" in\"").count(), preds, "in-edges highlighted");
    assert_eq!(
        dom.matches(" out\"").count(),
        succs,
        "out-edges highlighted"
    );

    // The error hook works: a page whose data does not parse reports it in the DOM.
    let broken = std::fs::read_to_string(&page)
        .unwrap()
        .replace("\"tasks\":[", "\"tasks\":[,");
    let bad = dir.join("broken.html");
    std::fs::write(&bad, broken).unwrap();
    let dom = dump_dom(&chromium, &dir, &format!("file://{}", bad.display()));
    assert!(
        body_attr(&dom, "data-errors").is_some_and(|e| !e.is_empty()),
        "a script error must be reported: {dom}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
