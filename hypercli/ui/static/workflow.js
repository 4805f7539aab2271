// One workflow: counts per experiment, and its tasks.
"use strict";
poll((d) => {
  const main = document.getElementById("main");
  if (d.error) { main.replaceChildren(el("p", {text: d.error})); return; }
  const w = encodeURIComponent(d.id);
  const exps = Object.entries(d.experiments).map(([e, c]) => {
    const total = Object.values(c).reduce((a, b) => a + b, 0);
    return [link("/w/" + w + "/r/" + encodeURIComponent(e), e), progressBar(c.succeeded || 0, total),
            c.succeeded || 0, c.running || 0, c.pending || 0, c.failed || 0, total];
  });
  const tasks = d.tasks.map((t) => [
    link("/w/" + w + "/t/" + encodeURIComponent(t.id), t.id), t.experiment,
    el("span", {class: "status-" + t.status, text: t.status}), t.node || "", t.attempts,
    fmtTime(t.started), fmtDur(t.duration)]);
  const et = table(["experiment", "progress", "done", "running", "pending", "failed", "total"], exps);
  et.id = "experiments";
  const tt = table(["task", "experiment", "status", "node", "attempts", "started", "duration"], tasks);
  tt.id = "tasks";
  main.replaceChildren(el("h2", {text: "Workflow " + d.id + " (" + d.status + ")"}), et,
                       el("h2", {text: "Tasks"}), tt);
});
