// Workflows with live progress, and clusters with their nodes' latest utilisation.
"use strict";

function fmtAge(s) {  // how long ago a node's latest sample was taken: "4 s ago", "12 min ago"
  if (s === null || s === undefined) return "";
  if (s < 90) return Math.round(s) + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}

poll((d) => {
  const main = document.getElementById("main");
  const rows = d.workflows.map((w) => {
    const exps = Object.keys(w.experiments);
    return [link("/w/" + encodeURIComponent(w.id), w.id), w.cluster,
            el("span", {class: "status-" + w.status, text: w.status}),
            progressBar(w.done, w.total), w.done + "/" + w.total,
            el("span", {}, ...exps.map((e) => {
              const a = link("/w/" + encodeURIComponent(w.id) + "/r/" + encodeURIComponent(e),
                             e + " results");
              a.style.marginRight = "8px";
              return a;
            })),
            fmtTime(w.created_at)];
  });
  const wt = table(["workflow", "cluster", "status", "progress", "done", "experiments",
                    "started"], rows);
  wt.id = "workflows";
  const nodes = [];
  for (const c of d.clusters) {
    for (const n of c.nodes) {
      // a sample that is not fresh (an idle node stops sampling) is not shown as current:
      // its values are left out and its age is said
      const s = (n.sample_fresh && n.sample) || {};
      const gpus = (s.gpus || []).map((g) => g.index + ":" + fmtVal(g.util_pct) + "%").join(" ");
      nodes.push([c.name, n.name, n.status, s.cpu_pct === undefined ? "" : s.cpu_pct + "%",
                  s.mem_used === undefined ? "" : fmtBytes(s.mem_used) + " / " + fmtBytes(s.mem_total),
                  gpus, fmtAge(n.sample_age)]);
    }
  }
  const ct = table(["cluster", "node", "status", "cpu", "memory", "gpus", "sampled"], nodes);
  ct.id = "nodes";
  main.replaceChildren(el("h2", {text: "Workflows"}), wt, el("h2", {text: "Clusters"}), ct);
});
