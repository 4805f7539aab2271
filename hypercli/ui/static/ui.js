// Shared helpers of the dashboard's pages. Data from the server is only ever put into the
// page as text (textContent), never as markup.
"use strict";
const PAGE = JSON.parse(document.getElementById("page-data").textContent);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function link(href, text) { return el("a", {href: href, text: text}); }

// Text for plotly, which reads a few HTML tags (<a href>, <b>) in its labels: entities only.
function plain(s) {
  return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function fmtTime(ts) { return ts ? new Date(ts * 1000).toLocaleTimeString() : ""; }

function fmtDur(s) {
  if (s === null || s === undefined) return "";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  return (s / 3600).toFixed(1) + " h";
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + u[i];
}

// Non-finite numbers come as the strings "NaN", "Infinity", "-Infinity" (JSON has none).
const NONFINITE = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"};

function fmtVal(v) {
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toPrecision(5);
  if (typeof v === "string" && Object.hasOwn(NONFINITE, v)) return NONFINITE[v];
  return v === undefined || v === null ? "" : String(v);
}

function table(headers, rows, onSort) {
  const head = el("tr", {});
  headers.forEach((h, i) => {
    const th = el("th", {text: h});
    if (onSort) th.addEventListener("click", () => onSort(i));
    head.append(th);
  });
  const t = el("table", {}, head);
  for (const r of rows) {
    const tr = el("tr", {});
    for (const c of r) {
      if (c instanceof Node) tr.append(el("td", {}, c));
      else tr.append(el("td", {text: fmtVal(c), class: typeof c === "number" ? "num" : ""}));
    }
    t.append(tr);
  }
  return t;
}

function progressBar(done, total) {
  const bg = el("span", {class: "barbg"});
  const w = total ? Math.round(160 * done / total) : 0;
  bg.append(el("span", {class: "bar", style: "width:" + w + "px"}));
  return bg;
}

// Fetch PAGE.api now and every POLL_MS, calling render(data) when the answer changed.
function poll(render) {
  let lastText = null;
  async function once() {
    try {
      const r = await fetch(PAGE.api, {credentials: "same-origin"});
      const text = await r.text();
      if (text === lastText) return;  // nothing new: the page stays as drawn
      lastText = text;
      render(JSON.parse(text));
    } catch (e) {
      document.getElementById("title").textContent += " (offline)";
    }
  }
  once();
  setInterval(once, window.POLL_MS);
}
