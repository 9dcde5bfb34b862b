// The dashboard's page: the overview (#) and a run's page (#run/STACK/RUN), updated by polling the JSON
// API and, for a run's log, by server-sent events. Everything shown is text (esc), never markup.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const OVERVIEW_POLL_MS = 1000;
const RUN_POLL_MS = 2000;
window.dashboard = { plots: {}, logLines: 0 };

function esc(value) {
  return String(value ?? "-").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
function when(iso) { return iso ? esc(iso.replace("T", " ").replace(/(\.\d+)?\+00:00$/, "Z")) : "-"; }
function usd(value) { return value == null ? "-" : "$" + Number(value).toFixed(4); }
function duration(s) {
  if (s == null) return "-";
  s = Math.round(s);
  return s >= 3600 ? `${Math.floor(s / 3600)}h${Math.floor((s % 3600) / 60)}m` : s >= 60 ? `${Math.floor(s / 60)}m${s % 60}s` : `${s}s`;
}
async function getJSON(path) {
  const response = await fetch(path, { headers: { "X-Dashboard-Token": TOKEN }, cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

// ------------------------------------------------------------------------------------------ overview

function runLink(stack, runId) { return `#run/${encodeURIComponent(stack)}/${encodeURIComponent(runId)}`; }

function verdicts(run) {
  const found = [];
  if (run.hang) found.push(`hang: ${run.hang}`);
  if (run.stragglers && run.stragglers.length) found.push(`stragglers: ${stragglers(run.stragglers)}`);
  if (run.participants) found.push(`participants ${run.participants}`);
  if (run.waiting_for) found.push(`waits for ${run.waiting_for}`);
  return found.map(esc).join("; ") || "";
}

function stragglers(named) {
  if (typeof named === "string") return named;
  return named.map((s) => (s && s.rank != null ? `rank ${s.rank} on ${s.node}${s.why ? ` (${s.why})` : ""}` : JSON.stringify(s))).join(", ");
}

function exitCodes(run) {
  const failed = Object.entries(run.exit_codes || {}).filter(([, code]) => code !== 0);
  const codes = failed.map(([node, code]) => `${node}: ${code}`).join(", ");
  return run.exit_code == null ? esc(codes || "-") : esc(`${run.exit_code}${codes ? ` (${codes})` : ""}`);
}

function timelineBars(timelines) {
  return timelines.map((t) => {
    const total = t.total_s || t.phases.reduce((sum, p) => sum + p.s, 0) || 1;
    const bars = t.phases.filter((p) => p.s > 0).map((p) =>
      `<span style="width:${(100 * p.s / total).toFixed(2)}%" title="${esc(p.phase)} ${p.s.toFixed(2)} s">${esc(p.phase)}</span>`).join("");
    return `<div>${esc(t.what)}: ${Number(total).toFixed(1)} s</div><div class="timeline">${bars}</div>`;
  }).join("");
}

function stackHTML(stack) {
  const nodes = stack.nodes.map((n) => `<tr class="node" data-node="${esc(n.name)}"><td>${esc(n.name)}</td><td>${esc(n.address)}</td>
    <td class="state-${esc(n.state)}" title="${esc(n.error)}">${esc(n.state)}</td><td>${esc(n.slurm)}</td>
    <td class="num">${duration(n.uptime_s)}</td><td class="num">${usd(n.hourly_usd)}</td></tr>`).join("");
  const runs = stack.runs.map((r) => `<tr class="run" data-run="${esc(r.run_id)}" data-state="${esc(r.state)}">
    <td><a href="${runLink(stack.stack, r.run_id)}">${esc(r.run_id)}</a></td><td>${esc(r.task)}</td>
    <td class="state-${esc(r.state)}">${esc(r.state)}</td><td class="nodes">${esc((r.nodes || []).join(" "))}</td>
    <td class="when">${when(r.submitted_at)}</td><td class="when">${when(r.started_at)}</td><td class="when">${when(r.ended_at)}</td>
    <td class="num">${esc(r.requeues)}</td><td>${exitCodes(r)}</td><td class="num">${usd(r.cost_usd)}</td>
    <td class="verdict">${verdicts(r)}</td></tr>`).join("");
  const counts = Object.entries(stack.counts).map(([s, n]) => `${n} ${esc(s.toLowerCase())}`).join(", ") || "no runs yet";
  const clusters = stack.clusters.map((c) => `<div class="cost" data-cluster="${c.id}">cluster #${c.id}: ${esc(c.nodes)} × ${esc(c.instance_type)},
    ${usd(c.hourly_usd)}/h, ${usd(c.cost_usd)} so far${c.up ? " (up)" : ""}${c.reference_hourly_usd != null
    ? `; on AWS ${usd(c.reference_hourly_usd)}/h, ${usd(c.series.ys["aws equivalent usd"]?.at(-1))} for the same time` : ""}<div class="plot cost-plot" id="cost-${esc(stack.stack)}-${c.id}"></div></div>`).join("");
  const reconciled = stack.reconciliation ? `<p class="reconciliation">bill: ${Object.entries(stack.reconciliation).map(([k, v]) => `${esc(k)} ${esc(v)}`).join(", ")}</p>` : "";
  return `<div class="stack" data-stack="${esc(stack.stack)}">
    <h1>${esc(stack.stack)} <small>${esc(stack.provider)}, ${esc(stack.instance_type)}, ${usd(stack.hourly_usd)}/h</small></h1>
    ${stack.problem ? `<p class="problem">${esc(stack.problem)}</p>` : ""}
    <h2>nodes</h2><table class="nodes"><tr><th>node</th><th>address</th><th>state</th><th>Slurm</th><th>uptime</th><th>$/h</th></tr>${nodes}</table>
    <h2>queue and runs <small>${counts}</small></h2>
    <div class="fits"><table class="runs"><tr><th>run</th><th>task</th><th>state</th><th>nodes</th><th>submitted</th><th>started</th><th>ended</th>
      <th>requeues</th><th>exit</th><th>cost</th><th>verdicts</th></tr>${runs}</table></div>
    <h2>cost over time</h2>${clusters || "<p>no ledger rows for this stack</p>"}${reconciled}
    <h2>timelines</h2>${timelineBars(stack.timelines) || "<p>none recorded</p>"}
  </div>`;
}

function drawCost(stack) {
  for (const c of stack.clusters) {
    const target = document.getElementById(`cost-${stack.stack}-${c.id}`);
    if (target && c.series.x.length) plot(target, `cost-${stack.stack}-${c.id}`, c.series, [], 360, 120);
  }
}

async function showOverview() {
  const data = await getJSON("/api/state");
  const section = document.getElementById("overview");
  section.innerHTML = data.stacks.map(stackHTML).join("") || "<p>no stack here: python deploy.py up --local</p>";
  data.stacks.forEach(drawCost);
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

// ------------------------------------------------------------------------------------------- plots

function markers(interruptions) {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        ctx.save();
        ctx.strokeStyle = "#b3261e";
        ctx.lineWidth = 2;
        for (const event of interruptions) {
          const x = u.valToPos(event.at, "x", true);
          ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

const COLOURS = ["#3b6fb6", "#c27c0e", "#5a9e4b", "#8e5bb5", "#2a9d8f", "#b5485b"];

function plot(target, name, series, interruptions, width = 420, height = 180) {
  const names = Object.keys(series.ys);
  const data = [series.x, ...names.map((n) => series.ys[n])];
  const old = window.dashboard.plots[name];
  target.dataset.points = String(series.x.length);
  if (old && old.root.isConnected && old.series.length === names.length + 1) {
    old.setData(data);
    return;
  }
  if (old) old.destroy();
  target.innerHTML = "";
  const options = {
    width, height,
    series: [{}, ...names.map((n, i) => ({ label: n, stroke: COLOURS[i % COLOURS.length], spanGaps: true, points: { show: series.x.length < 60 } }))],
    plugins: [markers(interruptions)],
  };
  window.dashboard.plots[name] = new uPlot(options, data, target);
}

// ---------------------------------------------------------------------------------------- run page

let current = null; // {stack, runId, source, timer}

function facts(run) {
  const rows = [["state", `<span id="run-state" class="state-${esc(run.state)}">${esc(run.state)}</span>`],
    ["task", esc(run.task)], ["nodes", esc((run.nodes || []).join(" "))], ["submitted", when(run.submitted_at)],
    ["started", when(run.started_at)], ["ended", when(run.ended_at)], ["requeues", esc(run.requeues)],
    ["exit", exitCodes(run)], ["cost", usd(run.cost_usd)], ["verdicts", `<span class="verdict">${verdicts(run) || "-"}</span>`]];
  return rows.map(([k, v]) => `<tr><th>${k}</th><td>${v}</td></tr>`).join("");
}

async function refreshRun() {
  if (!current) return;
  const data = await getJSON(`/api/runs/${encodeURIComponent(current.stack)}/${encodeURIComponent(current.runId)}`);
  const run = data.run;
  document.getElementById("run-title").textContent = `run ${run.run_id} (${current.stack})`;
  document.getElementById("run-facts").innerHTML = facts(run);
  document.getElementById("cancel").hidden = run.final;
  for (const name of ["loss", "throughput", "step_ms"]) {
    const figure = document.getElementById(`plot-${name}`);
    figure.parentElement.hidden = name !== "loss" && !data.plots[name].x.length; // a fault-tolerant run has no such plot
    plot(figure, name, data.plots[name], data.interruptions);
  }
  const participants = data.plots.participants;
  document.getElementById("participants-figure").hidden = !participants.x.length;
  if (participants.x.length) plot(document.getElementById("plot-participants"), "participants", participants, data.interruptions);
  document.getElementById("interruptions").textContent = data.interruptions.length
    ? "interruptions (red lines): " + data.interruptions.map((e) => `${e.kind} of ${e.node} at ${new Date(e.at * 1000).toLocaleTimeString()} (${e.detail})`).join("; ")
    : "";
  document.getElementById("run-timeline").innerHTML = data.timeline ? timelineBars([{ what: "launch", ...data.timeline }]) : "";
}

function followLog(stack, runId) {
  const log = document.getElementById("log");
  const state = document.getElementById("log-state");
  log.textContent = "";
  window.dashboard.logLines = 0;
  state.textContent = "following";
  const source = new EventSource(`/api/runs/${encodeURIComponent(stack)}/${encodeURIComponent(runId)}/log?token=${encodeURIComponent(TOKEN)}`);
  source.addEventListener("lines", (event) => {
    const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    const lines = JSON.parse(event.data);
    log.append(document.createTextNode(lines.map(([, line]) => line).join("\n") + "\n"));
    window.dashboard.logLines += lines.length;
    if (atEnd) log.scrollTop = log.scrollHeight;
  });
  source.addEventListener("end", () => { state.textContent = "(the whole log)"; source.close(); });
  return source;
}

async function cancelRun() {
  if (!current || !confirm(`Cancel run ${current.runId}? It stops on every node (fab stop --run).`)) return;
  const out = document.getElementById("cancel-result");
  out.textContent = "cancelling…";
  const response = await fetch(`/api/runs/${encodeURIComponent(current.stack)}/${encodeURIComponent(current.runId)}/cancel`,
    { method: "POST", headers: { "X-Dashboard-Token": TOKEN } });
  const reply = await response.json();
  out.textContent = reply.line || `error: ${reply.error}`;
  refreshRun();
}

// ------------------------------------------------------------------------------------------ routing

let overviewTimer = null;

function leaveRun() {
  if (!current) return;
  current.source.close();
  clearInterval(current.timer);
  current = null;
}

function route() {
  const match = location.hash.match(/^#run\/([^/]+)\/(.+)$/);
  document.getElementById("overview").hidden = !!match;
  document.getElementById("run").hidden = !match;
  leaveRun();
  clearInterval(overviewTimer);
  if (match) {
    const stack = decodeURIComponent(match[1]), runId = decodeURIComponent(match[2]);
    current = { stack, runId, source: followLog(stack, runId), timer: setInterval(() => refreshRun().catch(console.error), RUN_POLL_MS) };
    document.getElementById("cancel-result").textContent = "";
    refreshRun().catch(console.error);
  } else {
    showOverview().catch(console.error);
    overviewTimer = setInterval(() => showOverview().catch(console.error), OVERVIEW_POLL_MS);
  }
}

document.getElementById("cancel").addEventListener("click", cancelRun);
window.addEventListener("hashchange", route);
route();
