// An experiment's results: a sortable table, parameters -> metric as parallel coordinates,
// and the metric against each parameter.
"use strict";
const main = document.getElementById("main");
const tbl = el("div", {id: "results-table"});
const par = el("div", {class: "plot", id: "parcoords"});
const sc = el("div", {class: "plot", id: "scatter"});
main.append(el("h2", {text: "Results of " + PAGE.experiment}), tbl,
            el("h2", {text: "Parameters and the metric"}), par,
            el("h2", {text: "The metric against each parameter"}), sc);
let sortCol = null, sortAsc = false, last = null, lastKey = "";

function numeric(vals) { return vals.every((v) => typeof v === "number"); }

function dims(rows, key, get, log) {
  const vals = rows.map(get);
  if (log && numeric(vals) && vals.every((v) => v > 0)) {
    // parallel coordinates have no log axis: log10 of the values, ticked with the values
    const lo = Math.floor(Math.log10(Math.min(...vals)));
    const hi = Math.ceil(Math.log10(Math.max(...vals)));
    const ticks = [];
    for (let k = lo; k <= hi; k++) ticks.push(k);
    return {label: plain(key) + " (log)", values: vals.map(Math.log10), tickvals: ticks,
            ticktext: ticks.map((k) => fmtVal(Number("1e" + k)))};
  }
  if (numeric(vals)) return {label: plain(key), values: vals};
  const cats = [...new Set(vals.map(String))];
  return {label: plain(key), values: vals.map((v) => cats.indexOf(String(v))),
          tickvals: cats.map((_, i) => i), ticktext: cats.map(plain)};
}

function render(d) {
  const cols = ["task", "status", ...d.params, ...d.metrics];
  const get = (r, i) => i === 0 ? r.task : i === 1 ? r.status :
    i < 2 + d.params.length ? r.params[cols[i]] : r.metrics[cols[i]];
  let rows = d.rows.slice();
  if (sortCol !== null) {
    rows.sort((a, b) => {
      const x = get(a, sortCol), y = get(b, sortCol);
      if (x === undefined) return 1; if (y === undefined) return -1;
      const c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
      return sortAsc ? c : -c;
    });
  }
  const t = table(cols, rows.map((r) => cols.map((_, i) => i === 0 ?
    link("/w/" + encodeURIComponent(d.workflow) + "/t/" + encodeURIComponent(r.task), r.task) : get(r, i))),
    (i) => { sortAsc = sortCol === i ? !sortAsc : false; sortCol = i; render(last); });
  t.id = "results";
  tbl.replaceChildren(t);
  performance.mark("table");
  const m = d.metric;
  const done = d.rows.filter((r) => m !== null && typeof r.metrics[m] === "number");
  const key = JSON.stringify(done.map((r) => [r.task, r.metrics[m]]));
  if (!m || key === lastKey) return;  // redraw the plots only when a point changed
  lastKey = key;
  const logs = new Set(d.log_params || []);  // drawn with log: true: log axes
  Plotly.react(par, [{type: "parcoords",
    line: {color: done.map((r) => r.metrics[m]), showscale: true},
    dimensions: [...d.params.map((p) => dims(done, p, (r) => r.params[p], logs.has(p))),
                 {label: plain(m), values: done.map((r) => r.metrics[m])}]}],
    {margin: {t: 40, l: 60, r: 60}});
  performance.mark("parcoords");
  const traces = d.params.map((p, i) => ({
    type: "scatter", mode: "markers", name: plain(p),
    x: done.map((r) => typeof r.params[p] === "string" ? plain(r.params[p]) : r.params[p]),
    y: done.map((r) => r.metrics[m]), text: done.map((r) => plain(r.task)),
    xaxis: "x" + (i ? i + 1 : ""), yaxis: "y" + (i ? i + 1 : "")}));
  const layout = {grid: {rows: 1, columns: Math.max(1, d.params.length), pattern: "independent"},
                  yaxis: {title: {text: plain(m)}}, showlegend: false, margin: {t: 30}};
  d.params.forEach((p, i) => {
    layout["xaxis" + (i ? i + 1 : "")] = {title: {text: plain(p)}, type: logs.has(p) ? "log" : "-"};
  });
  Plotly.react(sc, traces, layout);
  performance.mark("scatter");
}

poll((d) => {
  performance.mark("data");
  if (d.error) { main.replaceChildren(el("p", {text: d.error})); return; }
  last = d;
  render(d);
});
