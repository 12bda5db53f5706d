// stepwatch's page: the node, a job, a rank's step anatomy. Plain JS and
// hand-drawn SVG, polling /api/v1 once a second; no library, no build step.
// Routes live in the URL's hash so that a view can be shared:
//   #/                               the node (GPUs, jobs)
//   #/jobs/JOB?namespace=NS          a job's ranks side by side
//   #/jobs/JOB/ranks/R?namespace=NS  a rank's step anatomy
"use strict";
(() => {
  const POLL_MS = 1000;
  const NODE_SECONDS = 60;
  const SVGNS = "http://www.w3.org/2000/svg";
  const main = document.getElementById("main");
  const statusEl = document.getElementById("status");
  const crumbs = document.getElementById("crumbs");
  const pauseButton = document.getElementById("pause");
  let paused = false;
  let timer = null;
  // Each refresh has a number; a slower, older one does not overwrite a newer view.
  let generation = 0;
  // The open rank's siblings, for the [ and ] keys.
  let siblings = [];

  // ---- DOM helpers -------------------------------------------------------
  function setAttrs(e, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") e.textContent = v;
      else e.setAttribute(k, v === true ? "" : String(v));
    }
  }
  function append(e, kids) {
    for (const k of kids.flat(Infinity)) {
      if (k === null || k === undefined || k === false) continue;
      e.append(k instanceof Node ? k : String(k));
    }
  }
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    setAttrs(e, attrs);
    append(e, kids);
    return e;
  }
  function sv(tag, attrs, ...kids) {
    const e = document.createElementNS(SVGNS, tag);
    setAttrs(e, attrs);
    append(e, kids);
    return e;
  }

  // ---- formatting --------------------------------------------------------
  const gb = (b) => (b === null || b === undefined ? "–" : (b / 1e9).toFixed(2) + " GB");
  const signedGb = (b) =>
    b === null || b === undefined ? "–" : (b < 0 ? "−" : "+") + (Math.abs(b) / 1e9).toFixed(2) + " GB";
  const seconds = (s) =>
    s === null || s === undefined ? "–" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
  const enc = encodeURIComponent;
  const nsQuery = (ns, sep) => (ns ? sep + "namespace=" + enc(ns) : "");
  const jobHref = (job, ns) => "#/jobs/" + enc(job) + nsQuery(ns, "?");
  const rankHref = (job, ns, rank) => "#/jobs/" + enc(job) + "/ranks/" + rank + nsQuery(ns, "?");
  const jobApi = (job, ns) => "/api/v1/jobs/" + enc(job) + nsQuery(ns, "?");

  function parseRoute() {
    const raw = location.hash.replace(/^#/, "") || "/";
    const [path, query] = raw.split("?");
    const ns = new URLSearchParams(query || "").get("namespace") || "";
    let parts;
    try {
      parts = path.split("/").filter(Boolean).map(decodeURIComponent);
    } catch (_) {
      return { view: "node" };
    }
    if (parts[0] === "jobs" && parts.length === 2) return { view: "job", job: parts[1], ns };
    if (parts[0] === "jobs" && parts[2] === "ranks" && parts.length === 4 && /^\d+$/.test(parts[3])) {
      return { view: "rank", job: parts[1], ns, rank: Number(parts[3]) };
    }
    return { view: "node" };
  }

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }
  async function api(path) {
    const response = await fetch(path, { cache: "no-store" });
    let body = null;
    try {
      body = await response.json();
    } catch (_) {
      body = null;
    }
    if (!response.ok) {
      throw new HttpError(response.status, (body && body.error) || path + " answered " + response.status);
    }
    return body;
  }

  // ---- charts ------------------------------------------------------------
  function niceTicks(lo, hi, count) {
    const span = hi - lo;
    if (!(span > 0)) return [lo];
    const raw = span / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || mag * 10;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
    return ticks;
  }

  // An SVG chart: x in the caller's unit, y in bytes. `draw(X, Y, plot)`
  // returns the marks; the frame, grid and axes are drawn here.
  function chart({ width = 640, height = 230, x0, x1, y1, xLabel, xFmt, label, draw }) {
    const m = { l: 58, r: 12, t: 10, b: 30 };
    const pw = width - m.l - m.r;
    const ph = height - m.t - m.b;
    const X = (x) => m.l + ((x - x0) / (x1 - x0 || 1)) * pw;
    const Y = (y) => m.t + ph - (y / (y1 || 1)) * ph;
    const svg = sv("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": label });
    const yt = niceTicks(0, y1 / 1e9, 4);
    for (const t of yt) {
      const y = Y(t * 1e9);
      svg.append(sv("line", { class: "grid", x1: m.l, x2: m.l + pw, y1: y, y2: y }));
      svg.append(sv("text", { x: m.l - 6, y: y + 4, "text-anchor": "end", text: t + " GB" }));
    }
    for (const t of niceTicks(x0, x1, 6)) {
      const x = X(t);
      if (x > m.l + pw + 0.5) continue;
      svg.append(sv("line", { class: "axis", x1: x, x2: x, y1: m.t + ph, y2: m.t + ph + 4 }));
      svg.append(sv("text", { x, y: m.t + ph + 16, "text-anchor": "middle", text: xFmt(t) }));
    }
    svg.append(sv("text", { x: m.l + pw, y: height - 2, "text-anchor": "end", text: xLabel }));
    svg.append(sv("line", { class: "axis", x1: m.l, x2: m.l + pw, y1: m.t + ph, y2: m.t + ph }));
    append(svg, [draw(X, Y, { left: m.l, top: m.t, width: pw, height: ph })]);
    return svg;
  }
  const pts = (list) => list.map(([x, y]) => x.toFixed(1) + "," + y.toFixed(1)).join(" ");
  function hline(X, Y, x0, x1, y, cls, text) {
    return sv("g", {}, [
      sv("line", { class: cls, x1: X(x0), x2: X(x1), y1: Y(y), y2: Y(y) }),
      sv("text", { x: X(x1) - 4, y: Y(y) - 4, "text-anchor": "end", text }),
    ]);
  }
  function legend(items) {
    return el(
      "div",
      { class: "legend" },
      items.map(([cls, text, line]) => el("span", {}, el("i", { class: line ? "line" : "", style: `background: var(--${cls})` }), text)),
    );
  }

  // ---- the node ----------------------------------------------------------
  function rankState(ranks) {
    const figures = ranks.map((r) => r.figures || {});
    if (figures.some((f) => f.oom_risk)) return ["warn", "step-2 OOM predicted"];
    if (ranks.some((r) => r.ooms > 0)) return ["warn", "died: CUDA OOM"];
    if (figures.some((f) => f.low_headroom)) return ["caution", "low headroom"];
    if (figures.some((f) => f.predicted_peak_bytes !== null && f.predicted_peak_bytes !== undefined)) return ["ok", "fits"];
    return ["ok", "starting"];
  }
  const badge = ([cls, text]) => el("span", { class: "badge " + cls, text });

  // A MIG slice is a device of its own, on its GPU's index: name both.
  function deviceName(g) {
    return g.mig ? `GPU ${g.index} MIG ${g.mig.profile} (instance ${g.mig.gpu_instance_id})` : `GPU ${g.index}`;
  }

  function gpuCard(g, series) {
    const cap = g.capacity_bytes || g.total_bytes;
    // Room above the capacity line for its label.
    const top = Math.max(g.total_bytes || 0, cap || 0, 1) * 1.1;
    const points = (series && series.points) || [];
    const end = series ? series.to_ns : 0;
    const x = (t) => (t - end) / 1e9;
    const pct = g.used_bytes !== null && cap ? ` (${((100 * g.used_bytes) / cap).toFixed(0)}%)` : "";
    const rankOf = (k) => el("a", { href: rankHref(k.job, k.namespace, k.rank), "data-key": `gpu${g.index}-${k.job}-${k.rank}` }, `${k.job} rank ${k.rank}`);
    const processes = g.processes.length
      ? el(
          "table",
          { class: "processes" },
          el("tr", {}, el("th", { text: "PID" }), el("th", { class: "num", text: "memory" }), el("th", { text: "process" })),
          g.processes.map((p) =>
            el("tr", {}, el("td", { text: p.pid }), el("td", { class: "num", text: gb(p.used_bytes) }), el("td", {}, p.rank ? rankOf(p.rank) : el("span", { class: "muted", text: "other process (not a tracked rank)" }))),
          ),
        )
      : el("p", { class: "muted", text: "No compute processes listed." });
    return el(
      "section",
      { class: "card gpu", "data-gpu-index": g.index, "data-gpu-uuid": g.uuid, "aria-label": deviceName(g) },
      el("h2", {}, `${deviceName(g)} · ${g.name}`, " ", el("span", { class: "muted", text: g.uuid })),
      el(
        "p",
        { class: "figure" },
        el("strong", { class: "used", text: gb(g.used_bytes) }),
        ` used${pct} of `,
        el("strong", { class: "capacity", text: gb(cap) }),
        " usable",
        g.used_max_bytes !== null ? ` · 15 s max ${gb(g.used_max_bytes)}` : "",
        g.utilization_percent ? ` · utilisation ${g.utilization_percent.gpu}%` : "",
        g.up ? "" : el("span", { class: "badge warn", text: g.stale ? "stale" : "down" }),
      ),
      points.length
        ? chart({
            x0: -NODE_SECONDS,
            x1: 0,
            y1: top,
            xLabel: "seconds ago",
            xFmt: (t) => String(Math.round(t)),
            label: `GPU ${g.index} memory over the last ${NODE_SECONDS} s`,
            draw: (X, Y) => {
              const upper = points.map(([t, , max]) => [X(x(t)), Y(max)]);
              const lower = points.map(([t, min]) => [X(x(t)), Y(min)]).reverse();
              return [
                sv("polygon", { class: "range", points: pts(upper.concat(lower)) }),
                sv("polyline", { class: "nvml", points: pts(upper) }),
                cap ? hline(X, Y, -NODE_SECONDS, 0, cap, "capacity", "capacity " + gb(cap)) : null,
              ];
            },
          })
        : el("p", { class: "muted", text: "No samples held for this GPU yet." }),
      processes,
    );
  }

  async function nodeView() {
    const [gpus, jobs] = await Promise.all([api("/api/v1/gpus"), api("/api/v1/jobs")]);
    const [series, details] = await Promise.all([
      Promise.all(gpus.gpus.map((g) => api(`/api/v1/gpus/${enc(g.uuid)}/samples?seconds=${NODE_SECONDS}&points=300`).catch(() => null))),
      // A job may end and be evicted between the two requests.
      Promise.all(jobs.jobs.slice(0, 50).map((j) => api(jobApi(j.job, j.namespace)).catch(() => null))),
    ]);
    siblings = [];
    crumbs.replaceChildren(el("span", { text: "node " + gpus.node }));
    document.title = "stepwatch · " + gpus.node;
    const jobRows = jobs.jobs.slice(0, 50).map((j, i) => {
      const d = details[i];
      const ranks = d ? d.ranks : [];
      const predicted = ranks.map((r) => (r.figures || {}).predicted_peak_bytes).filter((v) => v !== null && v !== undefined);
      const lastStep = Math.max(0, ...ranks.map((r) => r.last_step || 0));
      return el(
        "tr",
        { class: "job", "data-job": j.job },
        el("td", {}, el("a", { href: jobHref(j.job, j.namespace), "data-key": "job-" + j.namespace + "/" + j.job }, j.job)),
        el("td", { text: j.namespace || "–" }),
        el("td", { class: "num", text: j.ranks.length }),
        el("td", { class: "num", text: lastStep || "–" }),
        el("td", { class: "num", text: predicted.length ? gb(Math.max(...predicted)) : "–" }),
        el("td", {}, badge(rankState(ranks))),
      );
    });
    return [
      el("h1", {}, "Node ", el("span", { id: "node-name", text: gpus.node })),
      gpus.nvml_up ? null : el("p", { class: "banner warn", text: "NVML is not up: " + gpus.nvml_status }),
      el("div", { class: "cards" }, gpus.gpus.map((g, i) => gpuCard(g, series[i]))),
      legend([["nvml", "used (max per bucket)", true], ["nvml", "min–max range"], ["cap", "capacity", true]]),
      el("h2", {}, "Jobs on this node"),
      jobs.jobs.length
        ? el(
            "table",
            { id: "jobs" },
            el("tr", {}, ["job", "namespace", "ranks", "step", "predicted peak", "state"].map((t, i) => el("th", { class: i >= 2 && i <= 4 ? "num" : null, text: t }))),
            jobRows,
          )
        : el("p", { class: "muted", text: "No training ranks have connected." }),
    ];
  }

  // ---- a job ---------------------------------------------------------------
  function outlierFigures(divergence) {
    const out = new Map();
    if (!divergence) return out;
    const add = (rank, what) => out.set(rank, (out.get(rank) || []).concat(what));
    // The figures the agent warns about by name; failing those, the spreads'.
    for (const n of divergence.named || []) add(n.rank, n.figure.replace(/_/g, " "));
    if (out.size) return out;
    for (const figure of ["peak", "activation", "duration", "steady"]) {
      const spread = divergence[figure];
      for (const o of (spread && spread.outliers) || []) add(o.rank, figure);
    }
    return out;
  }

  async function jobView(route) {
    const [d, gpus] = await Promise.all([api(jobApi(route.job, route.ns)), api("/api/v1/gpus").catch(() => ({ gpus: [] }))]);
    const gpuName = (uuid) => {
      const g = gpus.gpus.find((x) => x.uuid === uuid);
      return g ? deviceName(g) : uuid || "–";
    };
    siblings = d.ranks.map((r) => r.rank);
    crumbs.replaceChildren(el("a", { href: "#/", "data-key": "crumb-node" }, "node " + d.node), "›", el("span", { text: "job " + d.job }));
    document.title = "stepwatch · " + d.job;
    const outliers = outlierFigures(d.divergence);
    const figs = d.ranks.map((r) => r.figures || {});
    const top = Math.max(1, ...figs.flatMap((f) => [f.first_step_peak_bytes, f.steady_peak_bytes, f.predicted_peak_bytes, f.capacity_bytes].filter((v) => v)));
    const risky = d.ranks.filter((r) => (r.figures || {}).oom_risk);
    const advisories = d.ranks
      .flatMap((r) => ((r.figures || {}).advisories || []).map((a) => ({ rank: r.rank, ...a })))
      .sort((a, b) => b.issued_monotonic_ns - a.issued_monotonic_ns);
    const latestWarning = advisories.find((a) => a.kind === "step2_oom_predicted");
    const bars = chart({
      width: 900,
      height: 240,
      x0: 0,
      x1: d.ranks.length,
      y1: top * 1.08,
      xLabel: "rank",
      xFmt: () => "",
      label: `step-1, steady and predicted peaks of each rank of ${d.job}`,
      draw: (X, Y, plot) =>
        d.ranks.map((r, i) => {
          const f = figs[i];
          const w = Math.min(28, (X(1) - X(0)) / 4.5);
          const cx = X(i + 0.5);
          const bar = (k, v, cls) =>
            v ? sv("rect", { class: cls, x: cx + (k - 1.5) * w, y: Y(v), width: w - 2, height: plot.top + plot.height - Y(v) }, sv("title", { text: `rank ${r.rank} ${cls}: ${gb(v)}` })) : null;
          return sv("g", {}, [
            bar(0, f.first_step_peak_bytes, "bar-first"),
            bar(1, f.steady_peak_bytes, "bar-steady"),
            bar(2, f.predicted_peak_bytes, "bar-predicted" + (f.oom_risk ? " risk" : "")),
            f.capacity_bytes ? sv("line", { class: "capacity", x1: cx - 2 * w, x2: cx + 2 * w, y1: Y(f.capacity_bytes), y2: Y(f.capacity_bytes) }) : null,
            sv("text", { x: cx, y: plot.top + plot.height + 16, "text-anchor": "middle", text: (outliers.has(r.rank) ? "⚠ " : "") + "rank " + r.rank }),
          ]);
        }),
    });
    const rows = d.ranks.map((r, i) => {
      const f = figs[i];
      const out = outliers.get(r.rank);
      return el(
        "tr",
        { class: "rank" + (out ? " outlier" : ""), "data-rank": r.rank },
        el("td", {}, el("a", { href: rankHref(d.job, d.namespace, r.rank), "data-key": "rank-" + r.rank }, "rank " + r.rank)),
        el("td", { title: r.info.gpu_uuid, text: gpuName(r.info.gpu_uuid) }),
        el("td", { class: "num", text: r.last_step === null ? "–" : r.last_step }),
        el("td", { class: "num first-step-peak", text: gb(f.first_step_peak_bytes) }),
        el("td", { class: "num steady-peak", text: gb(f.steady_peak_bytes) }),
        el("td", { class: "num predicted-peak", text: gb(f.predicted_peak_bytes) }),
        el("td", { class: "num", text: gb(f.capacity_bytes) }),
        el("td", { class: "num", text: signedGb(f.headroom_bytes) }),
        el("td", {}, badge(rankState([r])), out ? [" ", el("span", { class: "badge outlier", text: "outlier: " + out.join(", ") })] : null),
      );
    });
    return [
      el("h1", {}, "Job ", el("span", { id: "job-name", text: d.job }), d.namespace ? el("span", { class: "muted", text: " in " + d.namespace }) : null),
      risky.length
        ? el("p", { class: "banner warn", id: "oom-warning" }, `Step-2 OOM predicted for rank${risky.length > 1 ? "s" : ""} ${risky.map((r) => r.rank).join(", ")}: `, latestWarning ? `rank ${latestWarning.rank}: ${latestWarning.message}` : "")
        : null,
      bars,
      legend([["nvml", "step-1 peak (light) · steady peak (NVML)"], ["pred", "predicted steady peak"], ["warn", "predicted: OOM"], ["cap", "capacity", true]]),
      el(
        "table",
        { id: "ranks" },
        el("tr", {}, ["rank", "GPU", "step", "step-1 peak", "steady peak", "predicted peak", "capacity", "headroom", "state"].map((t, i) => el("th", { class: i >= 2 && i <= 7 ? "num" : null, text: t }))),
        rows,
      ),
      outliers.size ? el("p", { class: "muted" }, `Outliers: ranks whose figure is more than ${Math.round(100 * d.divergence.threshold)}% from the job's median on this node.`) : null,
      el("h2", {}, "Advisories"),
      advisories.length
        ? el("ul", { class: "advisories" }, advisories.map((a) => el("li", {}, el("strong", { text: `rank ${a.rank}, step ${a.step}: ` }), a.message)))
        : el("p", { class: "muted", text: "None sent." }),
    ];
  }

  // ---- a rank's step anatomy -------------------------------------------------
  const phaseEnd = (p) => p.start_monotonic_ns + (p.duration_seconds || 0) * 1e9;

  async function stepSamples(gpu, step) {
    if (!gpu || !step.duration_seconds) return null;
    const from = step.begin_monotonic_ns;
    const to = Math.ceil(from + step.duration_seconds * 1e9) + 1;
    return api(`/api/v1/gpus/${enc(gpu)}/samples?from_ns=${from}&to_ns=${to}&points=200`).catch(() => null);
  }

  function stepMarks(X, Y, step, samples, cls) {
    const t = (ns) => (ns - step.begin_monotonic_ns) / 1e9;
    const marks = [];
    if (samples && samples.points.length > 1) {
      marks.push(sv("polyline", { class: "nvml " + cls, points: pts(samples.points.map(([ns, , max]) => [X(t(ns)), Y(max)])) }, sv("title", { text: `step ${step.step} NVML used` })));
    } else {
      // The samples are gone from the agent's window: each phase's NVML peak.
      const d = step.phases.filter((p) => p.nvml_peak_bytes !== null).map((p) => `M${X(t(p.start_monotonic_ns)).toFixed(1)},${Y(p.nvml_peak_bytes).toFixed(1)} H${X(t(phaseEnd(p))).toFixed(1)}`);
      if (d.length) marks.push(sv("path", { class: "nvml " + cls, d: d.join(" ") }, sv("title", { text: `step ${step.step} NVML peak per phase` })));
    }
    const allocated = [];
    const reserved = [];
    for (const p of step.phases) {
      if (p.allocator_at_start) {
        allocated.push([X(t(p.start_monotonic_ns)), Y(p.allocator_at_start.allocated_bytes)]);
        reserved.push([X(t(p.start_monotonic_ns)), Y(p.allocator_at_start.reserved_bytes)]);
      }
      if (p.allocator_at_end && p.duration_seconds !== null) {
        allocated.push([X(t(phaseEnd(p))), Y(p.allocator_at_end.allocated_bytes)]);
        reserved.push([X(t(phaseEnd(p))), Y(p.allocator_at_end.reserved_bytes)]);
        marks.push(sv("line", { class: "allocpeak", x1: X(t(p.start_monotonic_ns)), x2: X(t(phaseEnd(p))), y1: Y(p.allocator_at_end.allocated_peak_bytes), y2: Y(p.allocator_at_end.allocated_peak_bytes), opacity: cls === "step1" ? 0.5 : 1 }, sv("title", { text: `step ${step.step} ${p.phase}: allocated peak ${gb(p.allocator_at_end.allocated_peak_bytes)}` })));
      }
    }
    if (allocated.length > 1) marks.push(sv("polyline", { class: "allocated " + cls, points: pts(allocated) }));
    if (reserved.length > 1 && cls !== "step1") marks.push(sv("polyline", { class: "reserved", points: pts(reserved) }));
    return marks;
  }

  function phaseBands(X, plot, step, y, h) {
    const t = (ns) => (ns - step.begin_monotonic_ns) / 1e9;
    return step.phases
      .filter((p) => p.duration_seconds !== null)
      .map((p) =>
        sv("rect", { class: "band band-" + p.phase, x: X(t(p.start_monotonic_ns)), y, width: Math.max(0.5, X(t(phaseEnd(p))) - X(t(p.start_monotonic_ns))), height: h }, sv("title", { text: `step ${step.step} ${p.phase}${p.micro_batch ? " (micro-batch " + p.micro_batch + ")" : ""}: ${seconds(p.duration_seconds)}` })),
      );
  }

  async function rankView(route) {
    const [rep, jobs] = await Promise.all([
      api(`/api/v1/jobs/${enc(route.job)}/ranks/${route.rank}?steps=3${nsQuery(route.ns, "&")}`),
      api("/api/v1/jobs").catch(() => ({ jobs: [] })),
    ]);
    const j = jobs.jobs.find((x) => x.job === route.job && x.namespace === route.ns);
    siblings = j ? j.ranks : [route.rank];
    crumbs.replaceChildren(
      el("a", { href: "#/", "data-key": "crumb-node" }, "node " + rep.node), "›",
      el("a", { href: jobHref(rep.job, rep.namespace), "data-key": "crumb-job" }, "job " + rep.job), "›",
      el("span", { text: "rank " + rep.rank }),
    );
    document.title = `stepwatch · ${rep.job} rank ${rep.rank}`;
    const a = rep.analysis || {};
    const frozen = rep.prediction_before_step2;
    const pred = frozen || a.prediction || null;
    const step1 = rep.steps.find((s) => s.step === 1) || null;
    // The steady step to compare with step 1: the latest completed one;
    // failing that, a later step that ended otherwise (an OOM in step 2).
    const steady =
      [...rep.steps].reverse().find((s) => s.complete && s.step > 1) ||
      [...rep.steps].reverse().find((s) => s.step > 1 && s.outcome !== "running" && s.phases.some((p) => p.duration_seconds !== null)) ||
      null;
    const laterLabel = steady ? `step ${steady.step}${steady.complete ? "" : " (" + steady.outcome + ")"}` : "– (none completed yet)";
    const running = rep.steps.find((s) => s.outcome === "running") || null;
    const gpu = rep.info.gpu_uuid;
    const [s1, ss] = await Promise.all([step1 ? stepSamples(gpu, step1) : null, steady ? stepSamples(gpu, steady) : null]);
    const shown = [step1, steady].filter(Boolean);
    const duration = Math.max(0.001, ...shown.map((s) => s.duration_seconds || 0));
    const peaks = shown.flatMap((s) => s.phases.flatMap((p) => [p.nvml_peak_bytes, p.allocator_at_end && p.allocator_at_end.reserved_bytes, p.allocator_at_end && p.allocator_at_end.allocated_peak_bytes]));
    const cap = a.capacity_bytes || null;
    const top = Math.max(1, cap || 0, pred ? pred.predicted_peak_bytes : 0, ...peaks.filter((v) => v)) * 1.05;
    const risk = pred && pred.oom_risk;
    const warning = (rep.advisories || []).filter((x) => x.kind === "step2_oom_predicted").pop();
    const anatomy = shown.length
      ? chart({
          width: 900,
          height: 320,
          x0: 0,
          x1: duration,
          y1: top,
          xLabel: "seconds since the step began",
          xFmt: (t) => String(Number(t.toPrecision(3))),
          label: `memory over step 1 and ${laterLabel} of rank ${rep.rank}`,
          draw: (X, Y, plot) => [
            sv("g", { opacity: 0.9 }, phaseBands(X, plot, steady || step1, plot.top, plot.height)),
            steady && step1 ? sv("g", {}, phaseBands(X, plot, step1, plot.top + plot.height - 10, 10)) : null,
            step1 ? stepMarks(X, Y, step1, s1, "step1") : null,
            steady ? stepMarks(X, Y, steady, ss, "steady") : null,
            cap ? hline(X, Y, 0, duration, cap, "capacity", "GPU capacity " + gb(cap)) : null,
            pred ? hline(X, Y, 0, duration * 0.8, pred.predicted_peak_bytes, "predicted", "predicted steady peak " + gb(pred.predicted_peak_bytes)) : null,
          ],
        })
      : el("p", { class: "muted", text: "No step has begun yet." });
    const phaseKey = (p) => p.phase + "/" + p.micro_batch;
    const steadyPhases = new Map((steady ? steady.phases : []).map((p) => [phaseKey(p), p]));
    const phaseRows = (step1 ? step1.phases : []).map((p) => {
      const q = steadyPhases.get(phaseKey(p));
      const ap = (x) => x && x.allocator_at_end && x.allocator_at_end.allocated_peak_bytes;
      return el(
        "tr",
        {},
        el("td", {}, el("span", { class: "badge", style: `background: var(--${p.phase})`, text: p.phase }), p.micro_batch ? ` mb ${p.micro_batch}` : ""),
        el("td", { class: "num", text: seconds(p.duration_seconds) }),
        el("td", { class: "num", text: gb(p.nvml_peak_bytes) }),
        el("td", { class: "num", text: q ? gb(q.nvml_peak_bytes) : "–" }),
        el("td", { class: "num", text: gb(ap(p)) }),
        el("td", { class: "num", text: q ? gb(ap(q)) : "–" }),
      );
    });
    const fit = pred && pred.what_would_fit;
    const fitText = fit
      ? [fit.fits_with_micro_batch_size ? `micro-batch ${fit.fits_with_micro_batch_size} (now ${fit.micro_batch_size})` : null, fit.fits_with_sharding_factor ? `sharding over ${fit.fits_with_sharding_factor} ranks` : null].filter(Boolean).join(" or ")
      : "";
    const figure = (label, value, cls) => el("div", {}, el("span", { class: "muted", text: label + " " }), el("strong", { class: "figure " + (cls || ""), text: value }));
    // After step 2: passes apart from the steps, batches, the spread of step peaks.
    const batchText = (x) => [x.tokens != null ? `${x.tokens} tokens` : null, x.samples != null ? `${x.samples} samples` : null, x.shape && x.shape.length ? `shape ${x.shape.join("×")}` : null].filter(Boolean).join(", ");
    const bt = rep.batches;
    const trailing = rep.memory_trend && rep.memory_trend.trailing;
    const after = [
      ...(rep.passes || []).map((p) => el("li", { id: `pass-${p.kind}` }, `${p.kind === "evaluation" ? "Evaluation passes" : "Checkpoint saves"} (${p.begun}): highest peak ${gb(p.highest.device_peak_bytes)} after step ${p.highest.after_step}, headroom ${signedGb(p.headroom_bytes)}.`)),
      bt && bt.largest ? el("li", { id: "batch-largest" }, `Largest batch seen: ${batchText(bt.largest.batch)} at step ${bt.largest.step}, peak ${gb(bt.largest_device_peak_bytes)}, headroom ${signedGb(bt.largest_headroom_bytes)}.`) : null,
      bt && bt.outlook ? el("li", { id: "batch-outlook", class: bt.outlook.headroom_bytes < 0 ? "warn" : "" }, `The loader's largest batch (${batchText(bt.outlook.batch)}) would need ${bt.outlook.at_least ? "at least" : "about"} ${gb(bt.outlook.device_peak_bytes)}: headroom ${signedGb(bt.outlook.headroom_bytes)}.`) : null,
      trailing && trailing.nvml_max_bytes != null ? el("li", { id: "step-spread" }, `Step peaks of the last ${trailing.steps} steps: ${gb(trailing.nvml_min_bytes)} to ${gb(trailing.nvml_max_bytes)}.`) : null,
    ].filter(Boolean);
    return [
      el("h1", {}, `${rep.job} · rank ${rep.rank}`, el("span", { class: "muted", text: ` on ${gpu || "an unknown GPU"}` })),
      risk
        ? el("p", { class: "banner warn", id: "oom-warning" }, "Step-2 OOM predicted: ", warning ? warning.message : `predicted peak ${gb(pred.predicted_peak_bytes)} exceeds capacity ${gb(cap)}`)
        : pred && pred.low_headroom
          ? el("p", { class: "banner caution" }, "Low headroom: ", signedGb(pred.headroom_bytes))
          : null,
      rep.post_mortem
        ? el("div", { class: "banner warn", id: "post-mortem" }, el("strong", { text: `Post-mortem (${rep.post_mortem.cause.replace(/_/g, " ")}): ` }), el("span", { text: rep.post_mortem.message }))
        : rep.ooms > 0
          ? el("p", { class: "banner warn", text: `This rank ran out of GPU memory (${rep.ooms}×).` })
          : null,
      rep.memory_growth && !rep.post_mortem
        ? el("p", { class: "banner caution", id: "memory-growth" }, `Memory grows by ${(rep.memory_growth.bytes_per_step / 1e6).toFixed(1)} MB per step (${rep.memory_growth.source}); capacity at about step ${rep.memory_growth.oom_step}.`)
        : null,
      el(
        "div",
        { class: "cards", style: "grid-template-columns: repeat(auto-fill, minmax(200px, 1fr))" },
        figure("step-1 peak", gb(a.first_step && a.first_step.nvml_peak_bytes), "first-step-peak"),
        figure("steady peak", gb(a.steady && a.steady.nvml_peak_bytes), "steady-peak"),
        figure(frozen ? "predicted before step 2" : "predicted steady peak", gb(pred && pred.predicted_peak_bytes), "predicted-peak"),
        figure("GPU capacity", gb(cap), "capacity"),
        figure("headroom", signedGb(pred && pred.headroom_bytes), "headroom"),
        figure("step", `${rep.last_step === null ? "–" : rep.last_step}${running ? " (running)" : ""} · ${rep.steps_completed} done`),
      ),
      after.length ? [el("h2", {}, "After step 2"), el("ul", { id: "after-step2" }, after)] : null,
      el("h2", {}, `Step anatomy: step 1 (dashed) over ${laterLabel}`),
      anatomy,
      legend([
        ["forward", "forward"], ["backward", "backward"], ["optimizer", "optimizer"], ["prologue", "other phases"],
        ["nvml", "NVML used", true], ["alloc", "allocator allocated (thick: peak in phase)", true], ["reserved", "allocator reserved", true],
        ["pred", "prediction", true], ["cap", "capacity", true],
      ]),
      el("p", { class: "muted" }, steady && step1 ? "Bands: the steady step's phases; the strip at the bottom: step 1's. " : "", s1 && s1.points.length > 1 ? "" : "Step 1's samples have left the agent's window: its NVML line is each phase's peak."),
      el("h2", {}, "Why this prediction"),
      pred
        ? el("div", { class: "explanation" }, el("p", { id: "explanation", text: pred.explanation }), el("p", { class: "muted", text: `basis: ${pred.inputs.basis}${pred.provisional ? " (provisional: step 1 is still running)" : ""}${frozen ? "; frozen when step 2 began" : ""}.` }), fitText ? el("p", {}, "Predicted to fit: ", el("strong", { text: fitText }), ".") : null)
        : el("p", { class: "muted", text: "No prediction yet: it is made during step 1." }),
      el("h2", {}, `Phases: step 1 against ${laterLabel}`),
      el("table", { id: "phases" }, el("tr", {}, ["phase", "step-1 time", "step-1 NVML peak", "later NVML peak", "step-1 allocated peak", "later allocated peak"].map((t, i) => el("th", { class: i ? "num" : null, text: t }))), phaseRows),
      el("h2", {}, "Advisories"),
      (rep.advisories || []).length
        ? el("ul", { class: "advisories" }, rep.advisories.map((x) => el("li", {}, el("strong", { text: `step ${x.step}: ` }), x.message)))
        : el("p", { class: "muted", text: "None sent." }),
    ];
  }

  // ---- the loop --------------------------------------------------------------
  function setStatus(text, error) {
    statusEl.textContent = text;
    statusEl.className = error ? "error" : "";
  }

  let drawn = "";
  function render(nodes) {
    const holder = document.createElement("div");
    holder.append(...nodes.flat().filter((n) => n !== null && n !== undefined && n !== false));
    main.setAttribute("aria-busy", "false");
    // Unchanged data (a finished rank) leaves the page as it is, so that a
    // selection or the scroll position inside it survives the poll.
    if (holder.innerHTML === drawn) return;
    drawn = holder.innerHTML;
    // Re-rendering replaces the elements: give focus back to the same link.
    const active = document.activeElement;
    const key = active && main.contains(active) ? active.getAttribute("data-key") : null;
    main.replaceChildren(...holder.childNodes);
    if (key) {
      const again = main.querySelector(`[data-key="${CSS.escape(key)}"]`);
      if (again) again.focus();
    }
  }

  async function refresh() {
    clearTimeout(timer);
    const mine = ++generation;
    const route = parseRoute();
    if (!document.hidden) {
      try {
        const nodes = route.view === "job" ? await jobView(route) : route.view === "rank" ? await rankView(route) : await nodeView();
        if (mine !== generation) return;
        render(nodes);
        setStatus(`${paused ? "paused" : "live"} · ${new Date().toLocaleTimeString()}`, false);
        document.body.dataset.view = route.view;
        document.body.dataset.state = "ready";
        // Counts the polls answered: a test sees that the page keeps polling.
        document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
      } catch (e) {
        if (mine !== generation) return;
        if (e instanceof HttpError && e.status === 404) {
          render([el("h1", { text: "Not on this node" }), el("p", { class: "banner caution", text: e.message }), el("p", {}, el("a", { href: "#/", "data-key": "back" }, "Back to the node"))]);
          setStatus("live", false);
          document.body.dataset.state = "not-found";
        } else {
          setStatus("cannot reach the agent: " + e.message, true);
          document.body.dataset.state = "error";
        }
      }
    }
    if (mine === generation && !paused) timer = setTimeout(refresh, POLL_MS);
  }

  function togglePause() {
    paused = !paused;
    pauseButton.textContent = paused ? "Resume" : "Pause";
    pauseButton.setAttribute("aria-pressed", String(paused));
    if (paused) {
      clearTimeout(timer);
      setStatus("paused", false);
    } else refresh();
  }

  pauseButton.addEventListener("click", togglePause);
  window.addEventListener("hashchange", () => {
    main.setAttribute("aria-busy", "true");
    refresh().then(() => main.focus({ preventScroll: true }));
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !paused) refresh();
  });
  document.addEventListener("keydown", (e) => {
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    const route = parseRoute();
    if (e.key === "n") location.hash = "#/";
    else if (e.key === "j" && route.view === "rank") location.hash = jobHref(route.job, route.ns);
    else if ((e.key === "[" || e.key === "]") && route.view === "rank" && siblings.length > 1) {
      const i = Math.max(0, siblings.indexOf(route.rank));
      const next = siblings[(i + (e.key === "]" ? 1 : siblings.length - 1)) % siblings.length];
      location.hash = rankHref(route.job, route.ns, next);
    } else if (e.key === "p") togglePause();
    else return;
    e.preventDefault();
  });
  refresh();
})();
