//! `simpler trace deps --html`: a self-contained page (inline CSS and JS, no network) that lays
//! the DAG out itself — layered by longest path from the sources, ordered by barycentre sweeps —
//! as SVG with pan (drag), zoom (wheel) and click-to-inspect.
//!
//! Every task node is an SVG `g` element carrying `data-task-id="<id>"`. A script error is
//! written into `data-errors` on `<body>` (and shown); a finished render sets
//! `data-rendered="<tasks>"`, so headless checks can read both from the DOM; `#task=<id>` in
//! the URL opens the page with that task selected.

use serde::Serialize;
use simpler_core::trace::{ArgRecord, DepGraph, ScopeKindRecord};

use crate::blocks::task_name;
use crate::deps::{Graph, kernel_label, overlap_name, source_name};
use crate::error::Result;

#[derive(Serialize)]
struct Payload<'a> {
    title: &'a str,
    fingerprint: &'a str,
    tasks: Vec<PTask<'a>>,
    edges: Vec<PEdge>,
    tensors: Vec<PTensor>,
}

#[derive(Serialize)]
struct PTask<'a> {
    id: String,
    name: String,
    kernel: String,
    blocks: u32,
    scope: &'static str,
    scope_depth: u32,
    args: &'a [ArgRecord],
}

#[derive(Serialize)]
struct PEdge {
    p: usize,
    s: usize,
    src: &'static str,
    ov: &'static str,
}

#[derive(Serialize)]
struct PTensor {
    buffer: u64,
    version: u32,
    dtype: String,
    size: u64,
}

/// The page for `g` (apply [`crate::deps::reduce`] first for a reduced view).
pub fn to_html(g: &DepGraph, title: &str) -> Result<String> {
    let graph = Graph::new(g)?;
    let tasks = g
        .tasks
        .iter()
        .map(|t| PTask {
            id: t.id.to_string(),
            name: task_name(t.id),
            kernel: kernel_label(t.kernel, &t.kernel_name),
            blocks: t.block_num,
            scope: match t.scope {
                ScopeKindRecord::Auto => "auto",
                ScopeKindRecord::Manual => "manual",
            },
            scope_depth: t.scope_depth,
            args: &t.args,
        })
        .collect();
    let mut seen = std::collections::HashSet::new();
    let edges = g
        .edges
        .iter()
        .filter_map(|e| {
            let (p, s) = (*graph.index.get(&e.pred)?, *graph.index.get(&e.succ)?);
            seen.insert((p, s)).then_some(PEdge {
                p,
                s,
                src: source_name(e.source),
                ov: overlap_name(e.overlap),
            })
        })
        .collect();
    let tensors = g
        .tensors
        .iter()
        .map(|t| PTensor {
            buffer: t.buffer,
            version: t.version,
            dtype: serde_json::to_value(t.dtype)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_else(|| format!("{:?}", t.dtype)),
            size: t.size,
        })
        .collect();
    let payload = Payload {
        title,
        fingerprint: &g.fingerprint,
        tasks,
        edges,
        tensors,
    };
    let json = serde_json::to_string(&payload)
        .map_err(|source| crate::DfxError::Json {
            path: "<html payload>".into(),
            line: 0,
            source,
        })?
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    let title_html = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    Ok(PAGE
        .replace("{{TITLE}}", &title_html)
        .replace("{{DATA}}", &json))
}

const PAGE: &str = r##"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{{TITLE}}</title>
<script>
window.onerror = function (msg, src, line, col) {
  var b = document.body || document.documentElement;
  b.setAttribute('data-errors', (b.getAttribute('data-errors') || '') + msg + ' (line ' + line + ':' + col + '); ');
  var el = document.getElementById('errors');
  if (el) { el.textContent += msg + ' (line ' + line + ')\n'; el.style.display = 'block'; }
};
</script>
<style>
html, body { margin: 0; height: 100%; font: 13px system-ui, sans-serif; color: #222; }
body { display: flex; flex-direction: column; }
header { padding: 6px 10px; background: #f3f3f3; border-bottom: 1px solid #ccc; display: flex; gap: 12px; align-items: center; }
header .legend span { margin-right: 10px; }
main { flex: 1; display: flex; min-height: 0; }
#view { flex: 1; cursor: grab; background: #fff; }
#view.dragging { cursor: grabbing; }
aside { width: 330px; overflow: auto; border-left: 1px solid #ccc; padding: 8px 10px; background: #fafafa; }
#errors { display: none; color: #fff; background: #b00; padding: 6px; white-space: pre-wrap; }
.node rect { fill: #e8f0fe; stroke: #4a6fa5; stroke-width: 1; }
.node text { font: 11px monospace; pointer-events: none; }
.node { cursor: pointer; }
.node.sel rect { fill: #ffd54f; stroke: #a67c00; stroke-width: 2; }
.node.pred rect { fill: #c8e6c9; }
.node.succ rect { fill: #ffcdd2; }
.edge { fill: none; stroke: #999; stroke-width: 1; }
.edge.src-tensormap { stroke: #4a6fa5; }
.edge.src-explicit { stroke: #2e7d32; }
.edge.ov-conservative { stroke-dasharray: 4 3; }
.edge.in { stroke: #2e7d32; stroke-width: 2.5; }
.edge.out { stroke: #c62828; stroke-width: 2.5; }
svg.focus .edge:not(.in):not(.out) { opacity: 0.15; }
svg.focus .node:not(.sel):not(.pred):not(.succ) { opacity: 0.35; }
aside h3 { margin: 4px 0; }
aside ul { padding-left: 18px; margin: 4px 0; }
aside a { color: #1a57b0; cursor: pointer; text-decoration: underline; }
table.kv td { padding: 1px 6px 1px 0; vertical-align: top; }
</style>
</head>
<body>
<div id="errors"></div>
<header>
  <b id="title"></b><span id="stats"></span>
  <button id="fit" type="button">fit</button>
  <span class="legend"><span style="color:#999">&#9472; creator</span><span style="color:#4a6fa5">&#9472; tensormap</span><span style="color:#2e7d32">&#9472; explicit</span><span>- - conservative overlap</span></span>
</header>
<main>
  <svg id="view" xmlns="http://www.w3.org/2000/svg"><g id="scene"><g id="edges"></g><g id="nodes"></g></g></svg>
  <aside id="details"><p>Drag to pan, wheel to zoom, click a task for its edges and details.</p></aside>
</main>
<script type="application/json" id="dag-data">{{DATA}}</script>
<script>
(function () {
  'use strict';
  var SVG = 'http://www.w3.org/2000/svg';
  var W = 150, H = 34, GX = 24, GY = 70;
  var D = JSON.parse(document.getElementById('dag-data').textContent);
  var n = D.tasks.length;
  document.getElementById('title').textContent = D.title;
  document.getElementById('stats').textContent = n + ' tasks, ' + D.edges.length + ' edges, fingerprint ' + (D.fingerprint || '-');

  var preds = [], succs = [], i;
  for (i = 0; i < n; i++) { preds.push([]); succs.push([]); }
  D.edges.forEach(function (e, k) { succs[e.p].push(k); preds[e.s].push(k); });

  // Topological order (Kahn, submit order among ties) and longest-path layers.
  var indeg = preds.map(function (p) { return p.length; });
  var queue = [], topo = [];
  for (i = 0; i < n; i++) if (indeg[i] === 0) queue.push(i);
  var qi = 0;
  while (qi < queue.length) {
    var v = queue[qi++];
    topo.push(v);
    succs[v].forEach(function (k) { var w = D.edges[k].s; if (--indeg[w] === 0) queue.push(w); });
  }
  if (topo.length !== n) throw new Error('the graph has a cycle');
  var layer = new Array(n).fill(0);
  topo.forEach(function (v) {
    succs[v].forEach(function (k) { var w = D.edges[k].s; if (layer[w] < layer[v] + 1) layer[w] = layer[v] + 1; });
  });
  var layers = [];
  for (i = 0; i < n; i++) { (layers[layer[i]] = layers[layer[i]] || []).push(i); }

  // Order within layers: barycentre sweeps, down then up.
  var pos = new Array(n).fill(0);
  function renumber() { layers.forEach(function (L) { L.forEach(function (v, k) { pos[v] = (k + 0.5) / L.length; }); }); }
  renumber();
  function sweep(L, nbrs, end) {
    var bary = {};
    L.forEach(function (v) {
      var ns = nbrs[v];
      if (!ns.length) { bary[v] = pos[v]; return; }
      var s = 0;
      ns.forEach(function (k) { s += pos[D.edges[k][end]]; });
      bary[v] = s / ns.length;
    });
    L.sort(function (a, b) { return bary[a] - bary[b] || a - b; });
  }
  for (var it = 0; it < 4; it++) {
    for (i = 1; i < layers.length; i++) { sweep(layers[i], preds, 'p'); renumber(); }
    for (i = layers.length - 2; i >= 0; i--) { sweep(layers[i], succs, 's'); renumber(); }
  }
  var X = new Array(n), Y = new Array(n);
  layers.forEach(function (L, li) {
    var width = L.length * (W + GX) - GX;
    L.forEach(function (v, k) { X[v] = k * (W + GX) - width / 2; Y[v] = li * (H + GY); });
  });

  // Draw.
  var edgeG = document.getElementById('edges'), nodeG = document.getElementById('nodes');
  var edgeEls = D.edges.map(function (e) {
    var x1 = X[e.p] + W / 2, y1 = Y[e.p] + H, x2 = X[e.s] + W / 2, y2 = Y[e.s], ym = (y1 + y2) / 2;
    var p = document.createElementNS(SVG, 'path');
    p.setAttribute('d', 'M' + x1 + ' ' + y1 + ' C' + x1 + ' ' + ym + ' ' + x2 + ' ' + ym + ' ' + x2 + ' ' + y2);
    p.setAttribute('class', 'edge src-' + e.src + ' ov-' + e.ov);
    edgeG.appendChild(p);
    return p;
  });
  var nodeEls = D.tasks.map(function (t, v) {
    var g = document.createElementNS(SVG, 'g');
    g.setAttribute('class', 'node');
    g.setAttribute('data-task-id', t.id);
    g.setAttribute('transform', 'translate(' + X[v] + ',' + Y[v] + ')');
    var r = document.createElementNS(SVG, 'rect');
    r.setAttribute('width', W); r.setAttribute('height', H); r.setAttribute('rx', 4);
    g.appendChild(r);
    [[t.name, 14], [t.kernel + ' \u00d7' + t.blocks, 27]].forEach(function (l) {
      var tx = document.createElementNS(SVG, 'text');
      tx.setAttribute('x', 6); tx.setAttribute('y', l[1]);
      tx.textContent = l[0].length > 22 ? l[0].slice(0, 21) + '\u2026' : l[0];
      g.appendChild(tx);
    });
    var title = document.createElementNS(SVG, 'title');
    title.textContent = t.name + ' ' + t.kernel;
    g.appendChild(title);
    g.addEventListener('click', function (ev) { if (!moved) { select(v); } ev.stopPropagation(); });
    nodeG.appendChild(g);
    return g;
  });

  // Pan and zoom.
  var svg = document.getElementById('view'), scene = document.getElementById('scene');
  var tx = 0, ty = 0, k = 1, drag = null, moved = false;
  function apply() { scene.setAttribute('transform', 'translate(' + tx + ',' + ty + ') scale(' + k + ')'); }
  function fit() {
    var minX = Infinity, minY = Infinity, maxX = -Infinity, maxY = -Infinity;
    for (var v = 0; v < n; v++) {
      minX = Math.min(minX, X[v]); minY = Math.min(minY, Y[v]);
      maxX = Math.max(maxX, X[v] + W); maxY = Math.max(maxY, Y[v] + H);
    }
    var r = svg.getBoundingClientRect(), vw = r.width || 800, vh = r.height || 600;
    if (!n) { tx = 0; ty = 0; k = 1; apply(); return; }
    k = Math.min(1, (vw - 40) / (maxX - minX), (vh - 40) / (maxY - minY));
    if (!(k > 0)) k = 1;
    tx = vw / 2 - k * (minX + maxX) / 2;
    ty = 20 - k * minY;
    apply();
  }
  svg.addEventListener('mousedown', function (ev) { drag = { x: ev.clientX, y: ev.clientY, tx: tx, ty: ty }; moved = false; svg.classList.add('dragging'); });
  window.addEventListener('mousemove', function (ev) {
    if (!drag) return;
    var dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 3) moved = true;
    tx = drag.tx + dx; ty = drag.ty + dy; apply();
  });
  window.addEventListener('mouseup', function () { drag = null; svg.classList.remove('dragging'); });
  svg.addEventListener('wheel', function (ev) {
    ev.preventDefault();
    var r = svg.getBoundingClientRect(), mx = ev.clientX - r.left, my = ev.clientY - r.top;
    var k2 = Math.max(0.02, Math.min(8, k * Math.exp(-ev.deltaY * 0.0015)));
    tx = mx - (mx - tx) * k2 / k; ty = my - (my - ty) * k2 / k; k = k2; apply();
  }, { passive: false });
  svg.addEventListener('click', function () { if (!moved) clear(); });
  document.getElementById('fit').addEventListener('click', fit);

  // Selection and details.
  var details = document.getElementById('details');
  function clear() {
    svg.classList.remove('focus');
    nodeEls.forEach(function (g) { g.classList.remove('sel', 'pred', 'succ'); });
    edgeEls.forEach(function (p) { p.classList.remove('in', 'out'); });
  }
  function el(tag, text) { var e = document.createElement(tag); if (text !== undefined) e.textContent = text; return e; }
  function taskList(title, ks, end) {
    details.appendChild(el('h3', title + ' (' + ks.length + ')'));
    var ul = el('ul');
    ks.forEach(function (kk) {
      var e = D.edges[kk], w = e[end], li = el('li'), a = el('a', D.tasks[w].name + ' ' + D.tasks[w].kernel);
      a.setAttribute('data-goto', String(w));
      a.addEventListener('click', function () { select(w, true); });
      li.appendChild(a);
      li.appendChild(document.createTextNode(' \u2014 ' + e.src + (e.src === 'tensormap' ? ' (' + e.ov + ')' : '')));
      ul.appendChild(li);
    });
    details.appendChild(ul);
  }
  function select(v, center) {
    clear();
    svg.classList.add('focus');
    nodeEls[v].classList.add('sel');
    preds[v].forEach(function (kk) { edgeEls[kk].classList.add('in'); nodeEls[D.edges[kk].p].classList.add('pred'); });
    succs[v].forEach(function (kk) { edgeEls[kk].classList.add('out'); nodeEls[D.edges[kk].s].classList.add('succ'); });
    var t = D.tasks[v];
    details.textContent = '';
    details.appendChild(el('h3', 'task ' + t.name));
    var tbl = el('table'); tbl.className = 'kv';
    [['id', t.id], ['kernel', t.kernel], ['blocks', t.blocks], ['scope', t.scope + ' (depth ' + t.scope_depth + ')'], ['layer', layer[v]]].forEach(function (r) {
      var tr = el('tr'); tr.appendChild(el('td', r[0])); tr.appendChild(el('td', String(r[1]))); tbl.appendChild(tr);
    });
    details.appendChild(tbl);
    if (t.args.length) {
      details.appendChild(el('h3', 'arguments'));
      var ul = el('ul');
      t.args.forEach(function (a) {
        var tn = D.tensors[a.tensor];
        var desc = a.tag + ' tensor #' + a.tensor + (tn ? ' (buffer ' + tn.buffer + ' v' + tn.version + ', ' + tn.dtype + ')' : '') +
          ' offset ' + a.offset + ' shape [' + a.shape.join(', ') + '] strides [' + a.strides.join(', ') + ']';
        ul.appendChild(el('li', desc));
      });
      details.appendChild(ul);
    }
    taskList('in-edges (predecessors)', preds[v], 'p');
    taskList('out-edges (successors)', succs[v], 's');
    if (center) {
      var r = svg.getBoundingClientRect();
      tx = (r.width || 800) / 2 - k * (X[v] + W / 2); ty = (r.height || 600) / 2 - k * (Y[v] + H / 2); apply();
    }
  }
  fit();
  window.addEventListener('resize', fit);
  // `page.html#task=<id>` opens with that task selected (links and headless checks).
  function fromHash() {
    var m = /^#task=(\d+)$/.exec(location.hash);
    if (!m) return;
    for (var v = 0; v < n; v++) if (D.tasks[v].id === m[1]) { select(v, true); document.body.setAttribute('data-selected', m[1]); }
  }
  window.addEventListener('hashchange', fromHash);
  fromHash();
  document.body.setAttribute('data-rendered', String(n));
})();
</script>
</body>
</html>
"##;
