// The admin page: asks for http.admin_token (kept in this tab's sessionStorage), then
// reads the gateway's /admin/api/* views. Everything shown is set as text, never as HTML.
(function () {
  "use strict";

  const TOKEN_KEY = "gw.admin_token";
  const PAGE = 50;
  const REFRESH_MS = 30000;

  const $ = (id) => document.getElementById(id);
  const login = $("login"), loginForm = $("login-form"), tokenInput = $("token"), loginError = $("login-error");
  const dashboard = $("dashboard"), notice = $("notice"), updated = $("updated");
  const refreshButton = $("refresh"), signoutButton = $("signout"), moreButton = $("sessions-more");

  let token = sessionStorage.getItem(TOKEN_KEY) || "";
  let nextSessions = null; // the cursor of the next sessions page
  let shownSessions = 0;
  let timer = null;

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(path, body) {
    const init = { headers: { Authorization: "Bearer " + token }, cache: "no-store" };
    if (body !== undefined) {
      init.method = "POST";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let resp;
    try {
      resp = await fetch("admin/api/" + path, init);
    } catch (err) {
      throw new ApiError(0, "The gateway did not answer (" + err.message + ").");
    }
    let data = null;
    try { data = await resp.json(); } catch (err) { data = null; }
    if (!resp.ok) {
      throw new ApiError(resp.status, (data && data.error) || ("The gateway answered " + resp.status + "."));
    }
    return data;
  }

  // -- formatting --------------------------------------------------------------------

  const number = new Intl.NumberFormat();
  const dateTime = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "short" });

  function ago(seconds) {
    const delta = Date.now() / 1000 - seconds;
    const past = delta >= 0, d = Math.abs(delta);
    let text;
    if (d < 45) text = Math.round(d) + " s";
    else if (d < 2700) text = Math.round(d / 60) + " min";
    else if (d < 86400 * 1.5) text = Math.round(d / 3600) + " h";
    else if (d < 86400 * 30) text = Math.round(d / 86400) + " d";
    else return dateTime.format(new Date(seconds * 1000));
    return past ? text + " ago" : "in " + text;
  }

  function duration(seconds) {
    if (seconds < 1) return Math.round(seconds * 1000) + " ms";
    if (seconds < 120) return seconds.toFixed(1) + " s";
    return Math.round(seconds / 60) + " min";
  }

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function when(seconds) {
    if (seconds === null || seconds === undefined) return el("td", "—", "muted");
    const cell = el("td", ago(seconds));
    cell.title = dateTime.format(new Date(seconds * 1000));
    return cell;
  }

  function wide(cell) { // a column narrow screens leave out
    cell.classList.add("wide");
    return cell;
  }

  function emptyRow(tbody, columns, text) {
    const row = el("tr", null, "empty");
    const cell = el("td", text, "muted");
    cell.colSpan = columns;
    row.append(cell);
    tbody.replaceChildren(row);
  }

  function showNotice(text, isError) {
    notice.textContent = text;
    notice.className = isError ? "error" : "ok";
    notice.hidden = false;
  }

  // -- views -------------------------------------------------------------------------

  async function loadStatus() {
    const data = await api("status");
    const list = $("channels");
    list.replaceChildren();
    for (const item of [...data.channels, ...data.checks]) {
      const chip = el("li", null, item.ok ? "chip ok" : "chip bad");
      chip.append(el("strong", item.name), el("span", item.ok ? "ready" : "not ready"));
      if (item.role) chip.append(el("span", item.role, "why"));
      if (item.detail) chip.append(el("span", item.detail, "why"));
      list.append(chip);
    }
    if (data.cluster) {
      // Several gateways on one database: which one this page talks to, and its peers.
      const c = data.cluster;
      // A channel received on one gateway at a time that no gateway receives is an outage.
      const unreceived = Object.entries(c.receivers || {}).filter(([, who]) => !who).map(([role]) => role);
      const chip = el("li", null, c.problem || unreceived.length ? "chip bad" : "chip ok");
      chip.append(el("strong", "cluster"));
      if (c.problem) chip.append(el("span", c.problem, "why"));
      else chip.append(el("span", c.gateways.length + (c.gateways.length === 1 ? " gateway" : " gateways") +
                              " · this one " + c.instance + " · " + c.leases + " leases"));
      for (const [role, who] of Object.entries(c.receivers || {})) {
        chip.append(el("span", who ? role + " received by " + (who === c.instance ? "this one" : who)
                                   : "nobody receives " + role, "why"));
      }
      if (c.gateways) chip.title = c.gateways.join("\n");
      list.append(chip);
    }
    showModels(data.model);
    const tools = $("tool-sources");
    tools.replaceChildren();
    if (!data.tool_sources.length) tools.append(el("li", "Only the built-in tools (no MCP servers configured).", "muted"));
    for (const source of data.tool_sources) {
      const good = ["ready", "connected"].includes(source.state);
      const off = source.state === "off";
      const chip = el("li", null, good ? "chip ok" : off ? "chip off" : "chip bad");
      const count = source.tools.length === 1 ? "1 tool" : source.tools.length + " tools";
      chip.append(el("strong", source.label || source.name), el("span", source.state + " · " + count));
      if (source.detail) chip.append(el("span", source.detail, "why"));
      chip.title = source.tools.length ? "Tools: " + source.tools.join(", ") : "No tools offered";
      tools.append(chip);
    }
  }

  // A model error's kind (gateway/model/errors.py) in words.
  const ERROR_WORDS = { overflow: "context too long", rate_limit: "rate limited", timeout: "timed out",
                        server: "server error", connection: "could not connect", auth: "key refused",
                        bad_request: "request refused", invalid_response: "unreadable answer",
                        not_configured: "no API key" };

  function errorText(e) {
    return (ERROR_WORDS[e.kind] || e.kind) + (e.status ? " (HTTP " + e.status + ")" : "") +
           (e.detail ? ": " + e.detail : "");
  }

  // Each configured model: its calls since the start, and whether the last one failed.
  function showModels(state) {
    const list = $("models");
    list.replaceChildren();
    for (const m of state.models) {
      const failed = Object.values(m.failures).reduce((a, b) => a + b, 0);
      const erring = m.last_error && (!m.last_ok_at || m.last_error.at > m.last_ok_at);
      const chip = el("li", null, !m.has_key || erring ? "chip bad" : "chip ok");
      chip.append(el("strong", m.name));
      if (m.role !== "model") chip.append(el("span", m.role, "why")); // an alias (models.NAME) or summary_model
      if (!m.has_key) chip.append(el("span", "no API key: every chat answers with what to set"));
      else if (!m.calls) chip.append(el("span", "no calls yet"));
      else chip.append(el("span", m.calls + " calls · " + failed + " failed" +
                                   (m.last_ok_at ? " · last answer " + ago(m.last_ok_at) : "")));
      if (m.last_error) {
        const last = el("span", "last error " + ago(m.last_error.at) + ": " + errorText(m.last_error), "why");
        last.title = dateTime.format(new Date(m.last_error.at * 1000));
        chip.append(last);
      }
      list.append(chip);
    }
    const used = state.fallbacks.map((f) => f.from + " → " + f.to + " (" + f.times + "×)");
    $("fallbacks").textContent = used.length ? "Fallbacks used: " + used.join(", ") : "No fallback used.";
  }

  async function loadPairings() {
    const data = await api("pairings");
    showApproved(data.approved);
    const tbody = $("pairings").tBodies[0];
    if (!data.pending.length) return emptyRow(tbody, 5, "No one is waiting for approval.");
    tbody.replaceChildren();
    for (const p of data.pending) {
      const row = el("tr");
      row.dataset.code = p.code;
      const action = el("td");
      const button = el("button", "Approve", "approve");
      button.type = "button";
      button.addEventListener("click", () => approve(p.code, p.identity, button));
      action.append(button);
      row.append(el("td", p.identity), el("td", p.code, "mono"), wide(when(p.created_at)), wide(when(p.expires_at)),
                 action);
      tbody.append(row);
    }
  }

  function showApproved(people) {
    const tbody = $("approved").tBodies[0];
    if (!people.length) return emptyRow(tbody, 4, "Nobody approved by pairing yet.");
    tbody.replaceChildren();
    for (const p of people) {
      const row = el("tr");
      row.dataset.identity = p.identity;
      const action = el("td");
      const button = el("button", "Revoke", "revoke");
      button.type = "button";
      button.title = "Their next message gets a new pairing code";
      button.addEventListener("click", () => revoke(p.identity, button));
      action.append(button);
      row.append(el("td", p.identity, "mono"), when(p.approved_at), wide(el("td", p.approved_by, "mono")), action);
      tbody.append(row);
    }
  }

  async function approve(code, identity, button) {
    button.disabled = true;
    try {
      const data = await api("pairings/approve", { code: code });
      showNotice(data.message + (data.told ? " They were told in their chat." : ""), false);
    } catch (err) {
      if (handleAuth(err)) return;
      showNotice("Could not approve " + identity + ": " + err.message, true);
    }
    await guarded(loadPairings, "pairings");
  }

  async function revoke(identity, button) {
    button.disabled = true;
    try {
      const data = await api("pairings/revoke", { identity: identity });
      showNotice(data.message, false);
    } catch (err) {
      if (handleAuth(err)) return;
      showNotice("Could not revoke " + identity + ": " + err.message, true);
    }
    await guarded(loadPairings, "pairings");
  }

  function sessionRow(s) {
    const row = el("tr", null, "clickable");
    row.dataset.key = s.key;
    const key = el("td");
    const open = el("button", s.key, "open-session mono");
    open.type = "button";
    open.title = "Open this session: its recent messages and context";
    key.append(open);
    row.addEventListener("click", () => guarded(() => openSession(s.key), "session"));
    row.append(key, wide(el("td", s.channel)), el("td", s.agent),
               wide(el("td", s.model, "mono")), when(s.last_activity),
               el("td", number.format(s.turns), "num"), el("td", number.format(s.tokens_today), "num"));
    return row;
  }

  async function loadSessions(more) {
    const tbody = $("sessions").tBodies[0];
    const limit = more ? PAGE : Math.min(200, Math.max(PAGE, shownSessions));
    let query = "sessions?limit=" + limit;
    if (more && nextSessions) {
      query += "&before_at=" + encodeURIComponent(nextSessions.before_at) +
               "&before_key=" + encodeURIComponent(nextSessions.before_key);
    }
    const data = await api(query);
    if (!more) {
      tbody.replaceChildren();
      shownSessions = 0;
    }
    for (const s of data.sessions) tbody.append(sessionRow(s));
    shownSessions += data.sessions.length;
    if (!shownSessions) emptyRow(tbody, 7, "No sessions yet.");
    nextSessions = data.next;
    moreButton.hidden = !data.next;
    $("sessions-total").textContent = "(" + number.format(data.total) + ")";
  }

  // -- one session -------------------------------------------------------------------

  let openKey = null;

  function numbers(list, pairs) {
    list.replaceChildren();
    for (const [label, value] of pairs) {
      const item = el("div");
      item.append(el("dt", label), el("dd", value));
      list.append(item);
    }
  }

  async function openSession(key) {
    const data = await api("session?key=" + encodeURIComponent(key));
    openKey = key;
    for (const row of $("sessions").tBodies[0].rows) row.classList.toggle("selected", row.dataset.key === key);
    $("session-key").textContent = data.key;
    $("session-meta").textContent = "channel " + data.channel + " · agent " + data.agent + " · model " + data.model +
      " · last activity " + ago(data.last_activity) + " · scope " + data.scope;
    const c = data.context;
    if (c) {
      const share = c.budget > 0 ? " (" + Math.round(100 * c.tokens / c.budget) + "%)" : "";
      const pairs = [["tokens", number.format(c.tokens) + " of " + number.format(c.budget) + share],
                     ["turns", c.turns + " of " + c.max_turns],
                     ["messages", c.messages + " (" + c.user + " user, " + c.assistant + " assistant, " + c.tool + " tool)"],
                     ["summary", c.summary ? "yes" : "none"], ["model", c.model]];
      if (c.last_model && c.last_model !== c.model) pairs.push(["last answered by", c.last_model]);
      if (c.last_trim) pairs.push(["last trim", c.last_trim.strategy + ", " + number.format(c.last_trim.tokens_before) +
                                               " → " + number.format(c.last_trim.tokens_after) + " tokens"]);
      numbers($("session-context"), pairs);
    } else {
      numbers($("session-context"), [["context", "not in memory on this gateway now (loaded at its next message)"]]);
    }
    const list = $("session-messages");
    list.replaceChildren();
    if (!data.messages.length) list.append(el("li", "No messages yet.", "muted"));
    for (const m of data.messages) {
      const item = el("li", null, m.role);
      const head = el("div", null, "head");
      const time = el("time", ago(m.at));
      time.title = dateTime.format(new Date(m.at * 1000));
      head.append(el("span", m.role === "user" ? "person" : "reply"), el("span", "turn " + m.turn), time);
      item.append(head, el("div", m.text + (m.cut ? " …" : ""), "text"));
      list.append(item);
    }
    const section = $("session-section");
    section.hidden = false;
    section.scrollIntoView({ block: "nearest" });
  }

  function closeSession() {
    openKey = null;
    $("session-section").hidden = true;
    for (const row of $("sessions").tBodies[0].rows) row.classList.remove("selected");
  }

  function bindingText(match) {
    const parts = Object.entries(match).map(([field, value]) => field + " " + value);
    return parts.length ? parts.join(", ") : "every message";
  }

  async function loadAgents() {
    const data = await api("agents");
    const tbody = $("agents").tBodies[0];
    tbody.replaceChildren();
    for (const a of data.agents) {
      const where = data.bindings.filter((b) => b.agent === a.name).map((b) => bindingText(b.match));
      if (a.name === "default") where.push("everything no binding takes");
      const model = el("td", a.model + (a.fallbacks.length ? " → " + a.fallbacks.join(", ") : ""), "mono");
      const row = el("tr");
      row.append(el("td", a.name), model, wide(el("td", where.join("; ") || "nowhere: no binding names it")),
                 el("td", number.format(a.sessions), "num"), el("td", number.format(a.tokens_today), "num"));
      tbody.append(row);
    }
  }

  async function loadUsage() {
    const data = await api("usage");
    $("usage-zone").textContent = data.timezone ? "(" + data.timezone + ")" : "";
    const tbody = $("usage").tBodies[0];
    if (!data.people.length) return emptyRow(tbody, 4, "No usage in the last 14 days.");
    tbody.replaceChildren();
    const peak = Math.max(1, ...data.people.flatMap((p) => p.tokens));
    for (const p of data.people) {
      const row = el("tr");
      const bars = el("td");
      const chart = el("div", null, "bars");
      p.tokens.forEach((tokens, i) => {
        const bar = el("span", null, "bar");
        bar.style.height = Math.max(tokens ? 8 : 0, Math.round(100 * tokens / peak)) + "%"; // CSSOM: allowed by the CSP
        bar.title = data.days[i] + ": " + number.format(tokens) + " tokens, " + p.turns[i] + " turns";
        chart.append(bar);
      });
      bars.append(chart);
      row.append(el("td", p.identity, "mono"), el("td", number.format(p.total_turns), "num"),
                 el("td", number.format(p.total_tokens), "num"), bars);
      tbody.append(row);
    }
    if (data.more_people) {
      const row = el("tr", null, "empty");
      const cell = el("td", "… and " + data.more_people + " more", "muted");
      cell.colSpan = 4;
      row.append(cell);
      tbody.append(row);
    }
  }

  function outcomeCell(outcome, detail) {
    const cell = el("td", null, "outcome " + (outcome === "ok" ? "good" : outcome === "running" ? "" : "bad"));
    cell.append(el("span", outcome));
    if (detail) cell.append(el("div", detail, "detail"));
    return cell;
  }

  async function loadJobs() {
    const data = await api("jobs");
    const tbody = $("jobs").tBodies[0];
    if (!data.jobs.length) emptyRow(tbody, 4, "The scheduler is not running.");
    else tbody.replaceChildren();
    for (const job of data.jobs) {
      const row = el("tr");
      const last = job.last_run;
      row.append(el("td", job.name, "mono"), when(job.next_run), when(last && last.started_at),
                 last ? outcomeCell(last.outcome, last.detail) : el("td", "never run", "muted"));
      tbody.append(row);
    }
    const runs = $("runs").tBodies[0];
    if (!data.runs.length) return emptyRow(runs, 6, "No runs recorded yet.");
    runs.replaceChildren();
    for (const run of data.runs) {
      const row = el("tr");
      row.append(el("td", run.job, "mono"), el("td", run.slot, "mono"), when(run.started_at),
                 el("td", run.ended_at ? duration(run.ended_at - run.started_at) : "—"), outcomeCell(run.outcome),
                 el("td", run.detail || "", "detail"));
      runs.append(row);
    }
  }

  async function loadErrors() {
    const data = await api("errors");
    const list = $("errors");
    list.replaceChildren();
    if (!data.errors.length) list.append(el("li", "Nothing since the gateway started.", "muted"));
    for (const e of data.errors) {
      const item = el("li", null, e.level === "WARNING" ? "warning" : "failure");
      const head = el("div", null, "head");
      const time = el("time", ago(e.at));
      time.title = dateTime.format(new Date(e.at * 1000));
      head.append(el("span", e.level, "level"), el("span", e.logger, "mono"), time);
      item.append(head, el("div", e.message, "message"));
      const extras = Object.entries(e.extra || {});
      if (extras.length) item.append(el("div", extras.map(([k, v]) => k + "=" + v).join("  "), "extra mono"));
      list.append(item);
    }
  }

  // -- flow --------------------------------------------------------------------------

  const views = { status: loadStatus, pairings: loadPairings, agents: loadAgents, sessions: () => loadSessions(false),
                  usage: loadUsage, jobs: loadJobs, errors: loadErrors };

  function handleAuth(err) {
    if (err.status === 401) {
      signOut("The gateway did not accept that token. Check http.admin_token in its config.");
      return true;
    }
    if (err.status === 404) {
      signOut(err.message);
      return true;
    }
    return false;
  }

  async function guarded(load, name) {
    try {
      await load();
      return true;
    } catch (err) {
      if (!handleAuth(err)) showNotice("The " + name + " view could not be loaded: " + err.message, true);
      return false;
    }
  }

  async function loadAll() {
    const loads = Object.entries(views).map(([name, load]) => guarded(load, name));
    if (openKey) loads.push(guarded(() => openSession(openKey), "session"));
    const results = await Promise.all(loads);
    if (!token) return;
    if (results.every(Boolean) && notice.classList.contains("error")) notice.hidden = true; // recovered
    updated.textContent = "updated " + new Date().toLocaleTimeString();
  }

  function showDashboard() {
    login.hidden = true;
    dashboard.hidden = false;
    refreshButton.hidden = signoutButton.hidden = false;
    clearInterval(timer);
    timer = setInterval(() => { if (!document.hidden && token) loadAll(); }, REFRESH_MS);
  }

  function signOut(message) {
    token = "";
    closeSession();
    sessionStorage.removeItem(TOKEN_KEY);
    clearInterval(timer);
    dashboard.hidden = true;
    refreshButton.hidden = signoutButton.hidden = true;
    updated.textContent = "";
    login.hidden = false;
    loginError.textContent = message || "";
    loginError.hidden = !message;
    tokenInput.value = "";
    tokenInput.focus();
  }

  loginForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    token = tokenInput.value.trim();
    if (!token) return;
    loginError.hidden = true;
    try {
      await api("status"); // one request first: a wrong token is told at the prompt
    } catch (err) {
      if (!handleAuth(err)) {
        loginError.textContent = err.message;
        loginError.hidden = false;
      }
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    showDashboard();
    await loadAll();
  });

  refreshButton.addEventListener("click", () => { notice.hidden = true; loadAll(); });
  signoutButton.addEventListener("click", () => signOut(""));
  moreButton.addEventListener("click", () => guarded(() => loadSessions(true), "sessions"));
  $("session-close").addEventListener("click", closeSession);

  if (token) {
    showDashboard();
    loadAll();
  } else {
    signOut("");
  }
})();
