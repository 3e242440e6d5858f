// The Kiln dashboard: polls /dashboard/state.json every second and draws it. Plain JavaScript and SVG,
// no libraries, no build step. With API keys on, the key typed in is kept in sessionStorage and sent as
// a Bearer token; a 401 brings the key form back and stops polling.
"use strict";

const POLL_MS = 1000;
const PAGE_ROWS = 50;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

const COLUMNS = [  // key, header, format, text-aligned
  ["id", "session", (v) => v.slice(0, 10), true],
  ["owner", "owner", (v) => v ?? "", true],
  ["state", "state", (v) => v, true],
  ["history", "history tok", num],
  ["resident_tokens", "resident tok", num],
  ["resident_bytes", "resident", bytes],
  ["tier_bytes", "host + disk tier", bytes],
  ["policy", "KV policy", (v) => v, true],
  ["reused", "reused", num],
  ["prefilled", "prefilled", num],
  ["last_turn_s", "last turn", seconds],
  ["idle_s", "idle", seconds],
  ["ttl_s", "TTL", seconds],
  ["last_saved_at", "saved", ago],
  ["snapshot_bytes", "snapshot", bytes],
  ["save_failures", "save fails", num],
];

const view = { sort: "idle_s", asc: true, page: 0, filter: "", detail: null, state: null };

function num(v) { return v == null ? "–" : Math.round(v).toLocaleString("en"); }
function bytes(v) {
  if (v == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : v) + " " + units[i];
}
function seconds(v) {
  if (v == null) return "–";
  if (v < 1) return (v * 1000).toFixed(0) + " ms";
  if (v < 120) return v.toFixed(1) + " s";
  if (v < 7200) return (v / 60).toFixed(0) + " min";
  return (v / 3600).toFixed(1) + " h";
}
function ago(unix) { return unix == null ? "never" : seconds(Date.now() / 1000 - unix) + " ago"; }
function pct(v) { return v == null ? "–" : (100 * v).toFixed(1) + " %"; }
function sum(obj) { return Object.values(obj || {}).reduce((a, b) => a + b, 0); }

// ---- fetching ----------------------------------------------------------------------------------------

async function fetchJson(path) {
  const key = sessionStorage.getItem("kiln-key");
  const response = await fetch(path, { headers: key ? { Authorization: "Bearer " + key } : {}, cache: "no-store" });
  if (response.status === 401) {
    const body = await response.json().catch(() => ({}));
    throw Object.assign(new Error(body?.error?.message || "unauthorized"), { unauthorized: true });
  }
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

// One poll, then the next a second later; a refused key stops polling until another is typed in (the
// server throttles an address after repeated failed keys, so guessing on a timer would lock the page out).
let timer = null;
async function poll() {
  clearTimeout(timer);
  try {
    const state = await fetchJson("/dashboard/state.json");
    $("key-form").hidden = true;
    $("main").hidden = false;
    $("forget-key").hidden = !sessionStorage.getItem("kiln-key");
    render(state);
    if (view.detail) await renderDetail(view.detail);
  } catch (error) {
    if (error.unauthorized) {
      askForKey(sessionStorage.getItem("kiln-key") ? "That key was refused: " + error.message : null);
      return;
    }
    $("health").textContent = "unreachable";
    $("health").className = "badge bad";
  }
  timer = setTimeout(poll, POLL_MS);
}

function askForKey(message) {
  $("main").hidden = true;
  $("key-form").hidden = false;
  $("key-message").textContent = message || "This server requires an API key.";
  $("health").textContent = "API key required";
  $("health").className = "badge";
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("kiln-key", $("key").value.trim());
  $("key").value = "";
  poll();
});
$("forget-key").addEventListener("click", () => { clearTimeout(timer); sessionStorage.removeItem("kiln-key"); askForKey(); });

// ---- the overview ------------------------------------------------------------------------------------

function render(state) {
  view.state = state;
  const health = state.health.status;
  $("health").textContent = health;
  $("health").className = "badge " + (health === "serving" ? "ok" : "bad");
  const f = state.formats;
  $("formats").textContent = `${state.health.model} · weights ${f.weights} · KV ${f.kv_dtype}/${f.kv_codec} · page ${f.page_size} tok · speculation ${f.speculative} · policy ${f.kv_policy}`;
  $("updated").textContent = "updated " + new Date(state.generated_at * 1000).toLocaleTimeString();
  renderCards(state);
  renderCharts(state.history, state.pool);
  renderRequests(state.requests);
  for (const s of state.sessions) s.tier_bytes = s.host_bytes + s.disk_bytes;  // one column: the drill-down splits it
  renderTable(state.sessions);
}

function card(label, value, sub = "", bad = false) {
  return `<div class="card${bad ? " bad" : ""}"><div class="label">${label}</div><div class="value">${value}</div><div class="sub">${sub}</div></div>`;
}

function renderCards(s) {
  const last = s.history.length ? s.history[s.history.length - 1] : {};
  const pool = s.pool;
  const prompt = s.tokens.reused + s.tokens.prefilled;
  const snaps = s.snapshots;
  const failures = sum(snaps.save_failures) + snaps.verification_failures;
  const violations = sum(s.invariant_violations);
  const spec = s.speculation;
  $("cards").innerHTML = [
    card("sessions", num(s.health.sessions), `${num(s.sessions.length)} visible`),
    card("pages used", num(pool.used), `${num(pool.cached)} cached · ${num(pool.free)} free of ${num(pool.pages)}`),
    card("KV resident", bytes((pool.used + pool.cached) * pool.page_bytes), `host tier ${bytes(s.tiers.bytes.host)} · disk ${bytes(s.tiers.bytes.disk)}`),
    card("prompt reuse", pct(prompt ? s.tokens.reused / prompt : null), `${num(s.tokens.prefix_hits)} via prefix cache`),
    card("decode tok/s", last.decode_tps == null ? "–" : last.decode_tps.toFixed(1), `${num(s.tokens.generated)} generated`),
    card("TTFT p50 / p95", `${seconds(last.ttft_p50)} / ${seconds(last.ttft_p95)}`, "last 15 s and in flight"),
    card("turn p50 / p95", `${seconds(last.turn_p50)} / ${seconds(last.turn_p95)}`, "last 15 s; in flight: age so far"),
    card("speculation", pct(spec.proposed ? spec.accepted / spec.proposed : null), `${num(spec.accepted)} of ${num(spec.proposed)} drafted accepted`),
    card("constrained", num(s.constrained_requests), "grammar-constrained requests"),
    card("stored responses", num(s.responses.stored), `Responses API, in ${num(s.responses.sessions)} sessions (filter: responses)`),
    card("evictions", num(sum(s.evictions)), `ttl ${num(s.evictions.ttl)} · lru ${num(s.evictions.lru)} · preempted ${num(s.preemptions)}`),
    card("snapshots", `${num(sum(snaps.saves))} / ${num(sum(snaps.restores))}`, `saves / restores · ${snaps.store}`),
    card("snapshot bytes", bytes(snaps.bytes_written), `${bytes(snaps.dedup_bytes)} deduplicated`),
    card("snapshot failures", num(failures), Object.entries(snaps.save_failures).map(([k, v]) => `${k} ${v}`).join(" · ") || "none", failures > 0),
    card("invariant violations", num(violations), `inv1 ${num(s.invariant_violations.inv1)} · inv2 ${num(s.invariant_violations.inv2)}`, violations > 0),
  ].join("");
}

// The pool chart plots the pages in use, scaled to them: free pages (most of a large pool) are a number
// in the caption, or the used line would lie flat along the axis.
function renderCharts(history, pool) {
  $("pool-free").textContent = `· ${short(pool.free)} of ${short(pool.pages)} free`;
  lineChart($("chart-pool"), history, [["used", "used", "--c1"], ["cached", "cached", "--c2"]]);
  lineChart($("chart-evictions"), history, [["evicted_cached", "cached", "--c2"], ["evicted_idle", "idle", "--c3"],
                                            ["evicted_paused", "paused", "--c4"], ["evicted_waiting", "waiting", "--c5"],
                                            ["evicted_preempted", "preempted", "--c1"]]);
  lineChart($("chart-tokens"), history, [["reused", "reused", "--c3"], ["prefilled", "prefilled", "--c2"]]);
  lineChart($("chart-latency"), history, [["ttft_p50", "TTFT p50", "--c1"], ["ttft_p95", "TTFT p95", "--c4"],
                                          ["turn_p50", "turn p50", "--c3"], ["turn_p95", "turn p95", "--c2"]]);
  lineChart($("chart-decode"), history, [["decode_tps", "tok/s", "--c1"]]);
  lineChart($("chart-hits"), history, [["hit_rate", "reused / prompt", "--c3"]], 1);
  lineChart($("chart-snapshots"), history, [["saves", "saves", "--c1"], ["restores", "restores", "--c2"]]);
  lineChart($("chart-snapshot-bytes"), history, [["written_bps", "written", "--c1"], ["dedup_bps", "deduplicated", "--c3"]]);
}

// One SVG line chart: a series per [field, label, colour variable]; `top` fixes the y range's top.
// `data-last` carries the newest point's values and `data-top` the y range's top (read by tests and
// handy when inspecting the page).
function lineChart(svg, points, series, top = null) {
  const width = svg.clientWidth || 400, height = svg.clientHeight || 130;
  const left = 42, bottom = 14, plotW = width - left - 4, plotH = height - bottom - 20;
  const values = points.flatMap((p) => series.map(([k]) => p[k]).filter((v) => v != null));
  const max = top ?? (Math.max(0, ...values) || 1) * 1.1;  // an all-zero chart still gets an axis
  const x = (i) => left + (points.length < 2 ? plotW : (i / (points.length - 1)) * plotW);
  const y = (v) => 20 + plotH - (v / max) * plotH;
  let out = `<line class="axis" x1="${left}" y1="${y(0)}" x2="${width}" y2="${y(0)}"/>`
          + `<text x="${left - 4}" y="${y(max) + 4}" text-anchor="end">${short(max)}</text>`
          + `<text x="${left - 4}" y="${y(0)}" text-anchor="end">0</text>`;
  if (points.length > 1) out += `<text x="${left}" y="${height - 2}">${seconds(Date.now() / 1000 - points[0].t)} ago</text>`
                              + `<text x="${width - 4}" y="${height - 2}" text-anchor="end">now</text>`;
  let legend = "";  // one text of spans: the browser places each label after the last, whatever the font
  for (const [key, label, colour] of series) {
    const colourValue = getComputedStyle(document.documentElement).getPropertyValue(colour);
    let d = "";
    points.forEach((p, i) => {
      if (p[key] == null) return;
      d += (d && points[i - 1]?.[key] != null ? "L" : "M") + x(i).toFixed(1) + "," + y(p[key]).toFixed(1);
    });
    out += `<path d="${d}" fill="none" stroke="${colourValue}" stroke-width="1.5" data-series="${key}"/>`;
    legend += `<tspan style="fill:${colourValue}">■ ${label}</tspan> `;
  }
  svg.innerHTML = out + `<text x="4" y="10" xml:space="preserve">${legend}</text>`;
  const last = points[points.length - 1] || {};
  svg.dataset.last = JSON.stringify(Object.fromEntries(series.map(([k]) => [k, last[k] ?? null])));
  svg.dataset.top = max;
}

function short(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (v >= 1e3) return (v / 1e3).toFixed(1) + "k";
  return v >= 10 || Number.isInteger(v) ? v.toFixed(0) : v.toPrecision(2);
}

// ---- requests in flight ------------------------------------------------------------------------------

// The requests the engine holds now, the oldest PAGE_ROWS (the server sorts them oldest first): a
// session's names it (a click opens its drill-down), a stateless one (OpenAI API) says so. "prompt done":
// the prompt's tokens whose K/V is ready (reused or prefilled so far).
function renderRequests(requests) {
  $("request-count").textContent = requests.length ? `${num(requests.length)} now` : "none now";
  $("requests").tBodies[0].replaceChildren(...requests.slice(0, PAGE_ROWS).map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    const cells = [
      ["id", String(r.id), true], ["session", r.session ? r.session.slice(0, 10) : "stateless", true],
      ["owner", r.owner ?? "", true], ["state", r.state, true], ["age_s", seconds(r.age_s)], ["ttft_s", seconds(r.ttft_s)],
      ["prompt", num(r.prompt)], ["computed", num(r.computed)], ["generated", `${num(r.generated)} / ${num(r.max_tokens)}`],
    ];
    for (const [key, value, text] of cells) {
      const td = document.createElement("td");
      td.textContent = value;
      td.className = key + (text ? " text" : "");
      tr.appendChild(td);
    }
    if (r.session) tr.addEventListener("click", () => { view.detail = r.session; renderDetail(r.session); });
    return tr;
  }));
}

// ---- the sessions table -----------------------------------------------------------------------------

function renderTable(sessions) {
  const head = $("sessions").tHead.rows[0];
  if (!head.cells.length) {
    for (const [key, label, , text] of COLUMNS) {
      const th = document.createElement("th");
      th.textContent = label;
      th.dataset.key = key;
      if (text) th.className = "text";
      th.addEventListener("click", () => {
        view.asc = view.sort === key ? !view.asc : true;
        view.sort = key;
        renderTable(view.state.sessions);
      });
      head.appendChild(th);
    }
  }
  for (const th of head.cells) {
    th.classList.toggle("sorted", th.dataset.key === view.sort);
    th.classList.toggle("asc", th.dataset.key === view.sort && view.asc);
  }
  const needle = view.filter.toLowerCase();
  const rows = sessions.filter((s) => !needle || [s.id, s.state, s.policy, s.owner ?? "", s.responses ? "responses" : ""].some((v) => v.toLowerCase().includes(needle)));
  const sign = view.asc ? 1 : -1;
  rows.sort((a, b) => {
    const p = a[view.sort], q = b[view.sort];
    if (p == null || q == null) return (p == null) - (q == null);
    return (p < q ? -1 : p > q ? 1 : 0) * sign;
  });
  const pages = Math.max(1, Math.ceil(rows.length / PAGE_ROWS));
  view.page = Math.min(view.page, pages - 1);
  $("page").textContent = `page ${view.page + 1} of ${pages}`;
  $("session-count").textContent = `${rows.length} shown of ${sessions.length}`;
  const body = $("sessions").tBodies[0];
  body.replaceChildren(...rows.slice(view.page * PAGE_ROWS, (view.page + 1) * PAGE_ROWS).map((s) => {
    const tr = document.createElement("tr");
    tr.dataset.id = s.id;
    for (const [key, , format, text] of COLUMNS) {
      const td = document.createElement("td");
      td.textContent = format(s[key]);
      td.className = key + (text ? " text" : "") + ((key === "save_failures" && s[key] > 0) || s.state === "failed" && key === "state" ? " bad" : "");
      tr.appendChild(td);
    }
    tr.addEventListener("click", () => { view.detail = s.id; renderDetail(s.id); });
    return tr;
  }));
}

$("filter").addEventListener("input", (event) => { view.filter = event.target.value; view.page = 0; renderTable(view.state.sessions); });
$("prev").addEventListener("click", () => { view.page = Math.max(0, view.page - 1); renderTable(view.state.sessions); });
$("next").addEventListener("click", () => { view.page += 1; renderTable(view.state.sessions); });

// ---- one session's drill-down ------------------------------------------------------------------------

async function renderDetail(id) {
  let s;
  try {
    s = await fetchJson("/dashboard/sessions/" + encodeURIComponent(id) + ".json");
  } catch (error) {
    if (error.unauthorized) throw error;
    $("detail-id").textContent = id + " (no longer live)";
    return;
  }
  $("detail").hidden = false;
  $("detail-id").textContent = s.id;
  $("detail-facts").innerHTML = [
    card("state", s.state),
    card("history", num(s.history) + " tok", `${num(s.resident_tokens)} resident`),
    card("pages", num(s.pages), `global ${num(s.pages_by_group.global)} · window ${num(s.pages_by_group.sliding_window)}`),
    card("resident", bytes(s.resident_bytes), `host ${bytes(s.host_bytes)} · disk ${bytes(s.disk_bytes)}`),
    card("snapshot", ago(s.last_saved_at), `${bytes(s.snapshot_bytes)} · ${s.unsaved ? "unsaved changes" : "up to date"} · ${num(s.save_failures)} failed`, s.save_failures > 0),
    card("forgotten tok", num(s.forgotten), s.policy === "sink_window" ? "between sink and window: no longer read" : "none: the policy reads every key"),
    card("invariant violations", num(s.violations), s.violations ? "the session failed" : "none", s.violations > 0),
    card("turns kept", num(s.turns.length), "most recent last"),
    card("stored responses", num(s.responses), "Responses API: points in this session"),
  ].join("");
  turnsChart($("chart-turns"), s.turns);
  $("detail-snapshots").tBodies[0].replaceChildren(...s.snapshots.map((snapshot) => {
    const tr = document.createElement("tr");
    for (const [value, text] of [[snapshot.id, true], [snapshot.kind, true], [ago(snapshot.saved_at)], [num(snapshot.history)], [bytes(snapshot.bytes)]]) {
      const td = document.createElement("td");
      td.textContent = value;
      if (text) td.className = "text";
      tr.appendChild(td);
    }
    return tr;
  }));
  $("detail-no-snapshots").hidden = s.snapshots.length > 0;
}

function turnsChart(svg, turns) {
  const width = svg.clientWidth || 800, height = svg.clientHeight || 160;
  const left = 42, plotW = width - left - 44, plotH = height - 30;
  const maxTokens = Math.max(1, ...turns.map((t) => t.prefilled_tokens + t.reused_tokens)) * 1.1;
  const maxSeconds = Math.max(1e-3, ...turns.map((t) => t.total_s)) * 1.1;
  const slot = plotW / Math.max(1, turns.length);
  const base = 14 + plotH;
  const style = getComputedStyle(document.documentElement);
  const [reusedColour, prefilledColour, lineColour] = ["--c3", "--c2", "--c1"].map((c) => style.getPropertyValue(c));
  let out = `<line class="axis" x1="${left}" y1="${base}" x2="${left + plotW}" y2="${base}"/>`
          + `<text x="${left - 4}" y="18" text-anchor="end">${short(maxTokens)} tok</text>`
          + `<text x="${width - 2}" y="18" text-anchor="end">${seconds(maxSeconds)}</text>`
          + `<text x="${left}" y="10" style="fill:${reusedColour}">■ reused</text>`
          + `<text x="${left + 60}" y="10" style="fill:${prefilledColour}">■ prefilled</text>`
          + `<text x="${left + 130}" y="10" style="fill:${lineColour}">— latency</text>`;
  let d = "";
  turns.forEach((t, i) => {
    const w = Math.max(1, Math.min(slot * 0.7, 40)), x = left + i * slot + (slot - w) / 2;
    const reused = (t.reused_tokens / maxTokens) * plotH, prefilled = (t.prefilled_tokens / maxTokens) * plotH;
    out += `<rect x="${x}" y="${base - reused}" width="${w}" height="${reused}" fill="${reusedColour}"/>`
         + `<rect x="${x}" y="${base - reused - prefilled}" width="${w}" height="${prefilled}" fill="${prefilledColour}"/>`;
    d += (i ? "L" : "M") + (x + w / 2).toFixed(1) + "," + (base - (t.total_s / maxSeconds) * plotH).toFixed(1);
  });
  out += `<path d="${d}" fill="none" stroke="${lineColour}" stroke-width="1.5"/>`;
  svg.innerHTML = out;
}

$("detail-close").addEventListener("click", () => { view.detail = null; $("detail").hidden = true; });

poll();
