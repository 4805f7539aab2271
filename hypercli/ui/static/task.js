// A task: attempts, its environment (a secret as ***), logs (live while it runs) and
// utilisation charts.
"use strict";
let drawn = false;
const main = document.getElementById("main");
const at = el("div", {}), envt = el("div", {}), out = el("pre", {id: "stdout"}), err = el("pre", {id: "stderr"});
const cpu = el("div", {class: "plot", id: "cpu"}), mem = el("div", {class: "plot", id: "mem"});
main.append(el("h2", {text: "Attempts"}), at, el("h2", {text: "Environment"}), envt,
            el("h2", {text: "stdout"}), out,
            el("h2", {text: "stderr"}), err, el("h2", {text: "Utilisation"}), cpu, mem);
poll((d) => {
  if (d.error) { main.replaceChildren(el("p", {text: d.error})); return; }
  at.replaceChildren(table(["attempt", "node", "status", "exit code", "error", "started", "ended"],
    d.attempts.map((a) => [a.number, a.node, el("span", {class: "status-" + a.status, text: a.status}),
                           a.exit_code === null ? "" : a.exit_code, a.error || "",
                           fmtTime(a.started_at), fmtTime(a.ended_at)])));
  envt.replaceChildren(table(["variable", "value"], Object.entries(d.env || {}).sort()));
  const follow = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
  out.textContent = d.logs.stdout + (d.log_error ? "\n[" + d.log_error + "]" : "");
  err.textContent = d.logs.stderr;
  if (follow) out.scrollTop = out.scrollHeight;
  if (d.samples.length) {
    const x = d.samples.map((s) => new Date(s.ts * 1000));
    Plotly.react(cpu, [{x: x, y: d.samples.map((s) => s.cpu_pct), name: "cpu %", mode: "lines"}],
                 {title: {text: "CPU (100 = one core)"}, margin: {t: 40}});
    Plotly.react(mem, [{x: x, y: d.samples.map((s) => (s.rss || 0) / 1048576), name: "MiB",
                        mode: "lines"}], {title: {text: "resident memory, MiB"}, margin: {t: 40}});
    drawn = true;
  }
});
