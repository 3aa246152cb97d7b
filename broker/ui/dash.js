// FleetBroker dashboard: every page's script. The token lives in this tab's sessionStorage and
// goes to the API as a bearer token; the pages build their DOM with textContent only, so no job
// name or reason is ever parsed as HTML.
"use strict";

const TOKEN_KEY = "fleet.token";
const PAGES = [
  ["fleet", "index.html", "What runs where"],
  ["costs", "costs.html", "Costs"],
  ["recoveries", "recoveries.html", "Preemptions & migrations"],
  ["prices", "prices.html", "Prices"],
  ["queue", "queue.html", "Queue"],
];
const COLORS = ["#2f6fdf", "#e8833a", "#3aa76d", "#c23b3b", "#8e5ad6", "#20a5b5", "#b58a20",
  "#d35fa0", "#6b7690", "#7fb13c"];
const HOLDING = ["launching", "running", "suspending"];
const WAITING = ["queued", "suspended"];
const LIST_MAX = 10000; // the API's default api.max_list

// ---- formatting ----------------------------------------------------------------------------
const usdFormat = new Intl.NumberFormat("en-US", {style: "currency", currency: "USD"});
const usd = (v) => (v === null || v === undefined ? "–" : usdFormat.format(v));
const num = (v, digits = 0) => (v === null || v === undefined ? "–" :
  v.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits}));
const pct = (v) => (v === null || v === undefined ? "–" : num(100 * v, 1) + "%");
const when = (ts) => new Date(ts * 1000).toISOString().slice(5, 19).replace("T", " ");
// time-axis labels: to the minute, or to the second when the axis spans under an hour
function axis(ts) {
  const short = ts.length > 1 && ts[ts.length - 1] - ts[0] < 3600;
  return ts.map((t) => (short ? when(t).slice(6) : when(t).slice(0, 11)));
}
function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 120) return s + " s";
  if (s < 7200) return Math.round(s / 60) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}

// ---- the API -------------------------------------------------------------------------------
class AuthError extends Error {}

async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) throw new AuthError("no token");
  const resp = await fetch(path, {headers: {Authorization: "Bearer " + token},
    cache: "no-store"});
  if (resp.status === 401) throw new AuthError("token refused");
  const body = await resp.json();
  if (!resp.ok) throw new Error(body.error ? body.error.message : resp.statusText);
  return body;
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    for (const one of [].concat(v)) q.append(k, one);
  }
  return "?" + q.toString();
}

function toLogin() {
  sessionStorage.removeItem(TOKEN_KEY);
  location.replace("login.html");
}

// ---- DOM helpers (textContent only) ----------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function kpis(items) {
  return el("section", {class: "kpis"}, ...items.map(([id, label, value]) =>
    el("div", {class: "kpi"}, el("div", {class: "label", text: label}),
      el("div", {class: "value", "data-kpi": id, text: value}))));
}

// columns: [heading, cell(row) -> text, "num" for right-aligned]
function table(id, title, columns, rows, note) {
  const head = el("tr", {}, ...columns.map(([h, , kind]) =>
    el("th", {class: kind || "", text: h})));
  const body = el("tbody");
  for (const row of rows) {
    body.append(el("tr", {}, ...columns.map(([, cell, kind]) =>
      el("td", {class: kind || "", text: String(cell(row))}))));
  }
  const card = el("section", {class: "card"}, el("h2", {text: title}));
  if (note) card.append(el("p", {class: "muted", text: note}));
  if (!rows.length) card.append(el("p", {class: "muted", text: "none"}));
  card.append(el("table", {"data-table": id}, el("thead", {}, head), body));
  return card;
}

function chartCard(id, title) {
  const canvas = el("canvas", {"data-chart": id, role: "img", "aria-label": title});
  return [el("section", {class: "card"}, el("h2", {text: title}),
    el("div", {class: "chart"}, canvas)), canvas];
}

function draw(canvas, type, labels, datasets, options = {}) {
  datasets.forEach((d, i) => {
    const color = d.color || COLORS[i % COLORS.length];
    d.backgroundColor = d.backgroundColor || color;
    d.borderColor = d.borderColor || color;
    delete d.color;
  });
  return new Chart(canvas, {type, data: {labels, datasets},
    options: {animation: false, maintainAspectRatio: false, responsive: true,
      plugins: {legend: {position: "bottom"}}, ...options}});
}

const stacked = {scales: {x: {stacked: true}, y: {stacked: true, beginAtZero: true}}};

function sumBy(items, key, value) {
  const out = new Map();
  for (const it of items) out.set(key(it), (out.get(key(it)) || 0) + value(it));
  return out;
}

// ---- pages -----------------------------------------------------------------------------------
async function fleetPage(main) {
  const [cap, jobs] = await Promise.all([
    api("/v1/capacity"),
    api("/v1/jobs" + query({state: HOLDING, limit: LIST_MAX})),
  ]);
  const pools = new Map(cap.pools.map((p) => [p.id, p]));
  const region = (id) => (pools.has(id) ? pools.get(id).cloud + ":" + pools.get(id).region : id);
  main.append(kpis([
    ["gpus-used", "GPUs in use", num(cap.total.used) + " / " + num(cap.total.capacity)],
    ["jobs-holding", "Jobs on GPUs", num(jobs.total)],
    ["pools", "Pools", num(cap.pools.length)],
  ]));
  const [gpuCard, gpuCanvas] = chartCard("gpus-per-pool", "GPUs per pool: in use and free");
  const [jobCard, jobCanvas] = chartCard("jobs-per-region", "Jobs on GPUs per region and market");
  main.append(el("div", {class: "grid"}, gpuCard, jobCard));
  draw(gpuCanvas, "bar", cap.pools.map((p) => p.id), [
    {label: "in use", data: cap.pools.map((p) => p.used)},
    {label: "free", data: cap.pools.map((p) => p.free), color: "#c9d4ea"},
  ], {indexAxis: "y", scales: {x: {stacked: true, beginAtZero: true}, y: {stacked: true}}});
  const regions = [...new Set(jobs.jobs.map((j) => region(j.pool)))].sort();
  const markets = [...new Set(jobs.jobs.map((j) => (pools.get(j.pool) || {}).market || "?"))];
  draw(jobCanvas, "bar", regions, markets.sort().map((m) => ({
    label: m, data: regions.map((r) => jobs.jobs.filter((j) => region(j.pool) === r &&
      ((pools.get(j.pool) || {}).market || "?") === m).length),
  })), stacked);
  main.append(table("pools", "Pools", [
    ["pool", (p) => p.id], ["market", (p) => p.market], ["GPU", (p) => p.accelerator],
    ["capacity", (p) => num(p.capacity), "num"], ["in use", (p) => num(p.used), "num"],
    ["free", (p) => num(p.free), "num"],
    ["$/GPU-h", (p) => p.price_per_gpu_hour.toFixed(3), "num"],
  ], cap.pools));
  main.append(table("holding", "Jobs on GPUs", [
    ["job", (j) => j.id], ["team", (j) => j.team], ["state", (j) => j.state],
    ["pool", (j) => j.pool || "–"], ["GPUs", (j) => num(j.gpus), "num"],
    ["batch", (j) => (j.batch_size === null ? "–" : num(j.batch_size)), "num"],
    ["progress", (j) => pct(j.progress), "num"],
  ], jobs.jobs));
}

async function costsPage(main) {
  const [report, series] = await Promise.all([
    api("/v1/costs" + query({limit: LIST_MAX})), api("/v1/costs/series?buckets=60"),
  ]);
  const total = report.total;
  main.append(kpis([
    ["cost", "Spent", usd(total.cost_usd)],
    ["all-ondemand", "All on on-demand would be", usd(total.ondemand_cost_usd)],
    ["saving", "Saved", usd(total.ondemand_cost_usd - total.cost_usd)],
    ["saving-pct", "Saving", pct(total.saving)],
    ["gpu-hours", "GPU-hours", num(total.gpu_hours, 1)],
  ]));
  const [timeCard, timeCanvas] = chartCard("cost-over-time",
    "Cumulative cost: spot and on-demand against all on-demand");
  const [teamCard, teamCanvas] = chartCard("cost-per-team", "Cost per team");
  main.append(el("div", {class: "grid"}, timeCard, teamCard));
  draw(timeCanvas, "line", axis(series.t), [
    // spot and on-demand stack up to what was spent; all on-demand is a line of its own
    {label: "spot", data: series.spot_usd, fill: true, backgroundColor: "#2f6fdf55",
      stack: "spent"},
    {label: "on-demand", data: series.ondemand_usd, fill: "-1", color: "#e8833a",
      backgroundColor: "#e8833a55", stack: "spent"},
    {label: "all on-demand", data: series.all_ondemand_usd, color: "#6b7690",
      borderDash: [6, 4], stack: "reference"},
  ], {scales: {x: {ticks: {maxTicksLimit: 8}}, y: {stacked: true, beginAtZero: true,
    ticks: {callback: (v) => usd(v)}}},
  elements: {point: {radius: 0}}, plugins: {legend: {position: "bottom"}}});
  draw(teamCanvas, "bar", report.teams.map((t) => t.team), [
    {label: "spent", data: report.teams.map((t) => t.cost_usd)},
    {label: "all on-demand", data: report.teams.map((t) => t.ondemand_cost_usd),
      color: "#c9d4ea"},
  ], {scales: {y: {beginAtZero: true, ticks: {callback: (v) => usd(v)}}}});
  main.append(table("teams", "Per team", [
    ["team", (t) => t.team], ["GPU-hours", (t) => num(t.gpu_hours, 1), "num"],
    ["spent", (t) => usd(t.cost_usd), "num"],
    ["all on-demand", (t) => usd(t.ondemand_cost_usd), "num"],
    ["saving", (t) => pct(t.saving), "num"], ["intervals", (t) => num(t.intervals), "num"],
  ], report.teams));
  const shown = [...report.jobs].sort((a, b) => b.cost_usd - a.cost_usd).slice(0, 100);
  main.append(table("jobs", "Per job", [
    ["job", (r) => r.job], ["team", (r) => r.team], ["state", (r) => r.state],
    ["regions", (r) => r.regions.join(", ") || "–"],
    ["GPU-hours", (r) => num(r.gpu_hours, 2), "num"], ["spent", (r) => usd(r.cost_usd), "num"],
    ["saving", (r) => pct(r.saving), "num"],
    ["preemptions", (r) => num(r.preemptions), "num"],
    ["migrations", (r) => num(r.migrations), "num"],
  ], shown, `the ${shown.length} most expensive of ${num(report.jobs_total)} jobs`));
}

async function recoveriesPage(main) {
  const data = await api("/v1/recoveries?buckets=48");
  const sum = (kind) => Object.values(data.totals).reduce((a, t) => a + t[kind], 0);
  main.append(kpis([
    ["preemptions", "Preemptions", num(sum("preemptions"))],
    ["migrations", "Migrations", num(sum("migrations"))],
    ["regions", "Regions hit", num(data.regions.length)],
  ]));
  const labels = axis(data.t);
  const cards = [];
  for (const kind of ["preemptions", "migrations"]) {
    const [card, canvas] = chartCard(kind + "-over-time",
      (kind === "preemptions" ? "Preemptions" : "Migrations (by region left)") +
      " per region over time");
    cards.push([card, canvas, kind]);
  }
  main.append(el("div", {class: "grid"}, ...cards.map((c) => c[0])));
  for (const [, canvas, kind] of cards) {
    draw(canvas, "bar", labels, data.regions.map((r) => ({
      label: r, data: data.series[r][kind]})),
    {...stacked, scales: {x: {stacked: true, ticks: {maxTicksLimit: 8}},
      y: {stacked: true, beginAtZero: true, ticks: {precision: 0}}}});
  }
  main.append(table("regions", "Per region", [
    ["region", (r) => r], ["preemptions", (r) => num(data.totals[r].preemptions), "num"],
    ["migrations", (r) => num(data.totals[r].migrations), "num"],
  ], data.regions));
  const recent = data.events.slice(-50).reverse();
  main.append(table("events", "Latest", [
    ["when (UTC)", (e) => when(e.ts)], ["what", (e) => e.kind], ["job", (e) => e.job],
    ["region", (e) => e.region], ["moved to", (e) => e.to || "–"],
  ], recent, `the latest ${recent.length} of ${num(data.events_total)}`));
}

async function pricesPage(main) {
  const data = await api("/v1/prices");
  const rows = data.accelerators;
  const price = (o) => (o ? o.price_per_gpu_hour : null);
  const where = (o) => (o ? `${o.cloud} ${o.zone || o.region} ${o.instance_type}` : "–");
  const [card, canvas] = chartCard("prices", "Cheapest price per GPU-hour in the catalog");
  main.append(card);
  draw(canvas, "bar", rows.map((r) => r.accelerator), [
    {label: "on-demand", data: rows.map((r) => price(r.on_demand)), color: "#e8833a"},
    {label: "spot", data: rows.map((r) => price(r.spot)), color: "#2f6fdf"},
  ], {scales: {y: {beginAtZero: true, ticks: {callback: (v) => "$" + v}}}});
  const dollars = (v) => (v === null ? "–" : "$" + v.toFixed(3));
  main.append(table("prices", "Per accelerator (USD per GPU-hour)", [
    ["GPU", (r) => r.accelerator], ["on-demand", (r) => dollars(price(r.on_demand)), "num"],
    ["at", (r) => where(r.on_demand)], ["spot", (r) => dollars(price(r.spot)), "num"],
    ["at", (r) => where(r.spot)], ["spot saves", (r) => pct(r.spot_saving), "num"],
  ], rows));
}

async function queuePage(main) {
  const data = await api("/v1/jobs" + query({state: WAITING, limit: LIST_MAX}));
  const now = Date.now() / 1000;
  const waited = (j) => now - (j.state === "queued" ? j.submitted_at : j.updated_at);
  // the scheduler says on a job why it gets no GPUs; a job it has not looked at says nothing yet
  const reason = (j) => j.reason || "no reason given yet";
  const jobs = [...data.jobs].sort((a, b) => waited(b) - waited(a));
  main.append(kpis([
    ["waiting", "Jobs waiting", num(data.total)],
    ["gpus-wanted", "GPUs wanted (at least)", num(jobs.reduce((a, j) => a + j.spec.gpus.min, 0))],
    ["longest", "Longest wait", jobs.length ? duration(waited(jobs[0])) : "–"],
  ]));
  const byReason = [...sumBy(jobs, reason, () => 1)].sort((a, b) => b[1] - a[1]).slice(0, 12);
  const short = (s) => (s.length > 48 ? s.slice(0, 47) + "…" : s);
  const [card, canvas] = chartCard("waiting-by-reason", "Waiting jobs by reason");
  const [teamCard, teamCanvas] = chartCard("waiting-by-team", "Waiting jobs per team");
  main.append(el("div", {class: "grid"}, card, teamCard));
  draw(canvas, "bar", byReason.map(([r]) => short(r)), [
    {label: "jobs", data: byReason.map(([, n]) => n)}], {indexAxis: "y",
    plugins: {legend: {display: false}}, scales: {x: {beginAtZero: true, ticks: {precision: 0}}}});
  const byTeam = [...sumBy(jobs, (j) => j.team, () => 1)].sort();
  draw(teamCanvas, "bar", byTeam.map(([t]) => t), [
    {label: "jobs", data: byTeam.map(([, n]) => n), color: "#8e5ad6"}],
  {plugins: {legend: {display: false}}, scales: {y: {beginAtZero: true, ticks: {precision: 0}}}});
  main.append(table("queue", "The queue, longest wait first", [
    ["job", (j) => j.id], ["team", (j) => j.team], ["state", (j) => j.state],
    ["GPU", (j) => j.spec.accelerators.join(", ")],
    ["GPUs", (j) => `${j.spec.gpus.min}–${j.spec.gpus.max}`, "num"],
    ["priority", (j) => j.spec.priority, "num"], ["waiting", (j) => duration(waited(j)), "num"],
    ["reason", reason, "reason"],
  ], jobs));
}

// ---- frame -----------------------------------------------------------------------------------
function login() {
  const form = document.getElementById("login");
  const error = document.getElementById("login-error");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const token = document.getElementById("token").value.trim();
    const resp = await fetch("/v1/capacity", {headers: {Authorization: "Bearer " + token},
      cache: "no-store"});
    const body = await resp.json().catch(() => ({})); // read whole: leaving aborts it
    if (resp.ok) {
      sessionStorage.setItem(TOKEN_KEY, token);
      location.replace("index.html");
    } else {
      error.textContent = resp.status === 401 ? "The broker does not know this token." :
        (body.error ? body.error.message : "Sign-in failed (" + resp.status + ")");
    }
  });
}

function frame(page) {
  const nav = el("nav", {}, ...PAGES.map(([id, href, title]) => {
    const a = el("a", {href, text: title});
    if (id === page) a.setAttribute("aria-current", "page");
    return a;
  }));
  const out = el("button", {type: "button", text: "Sign out"});
  out.addEventListener("click", toLogin);
  document.getElementById("top").append(el("span", {class: "brand", text: "FleetBroker"}), nav,
    out);
}

async function start() {
  const page = document.body.dataset.page;
  if (page === "login") return login();
  if (!sessionStorage.getItem(TOKEN_KEY)) return toLogin();
  frame(page);
  const main = document.getElementById("main");
  const title = PAGES.find(([id]) => id === page)[2];
  main.append(el("h1", {text: title}));
  const render = {fleet: fleetPage, costs: costsPage, recoveries: recoveriesPage,
    prices: pricesPage, queue: queuePage}[page];
  try {
    await render(main);
  } catch (err) {
    if (err instanceof AuthError) return toLogin();
    main.append(el("p", {class: "error", role: "alert", text: err.message}));
  } finally {
    main.setAttribute("aria-busy", "false");
    // since the navigation started, as the browser counts it (the benchmark reads it)
    document.body.dataset.readyMs = performance.now().toFixed(1);
    document.body.dataset.ready = "1";
  }
}

start();
