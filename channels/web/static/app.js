// The web chat page: history on load, replies streamed as Server-Sent Events and rendered
// as sanitized Markdown (marked + DOMPurify, code highlighted by highlight.js; all vendored),
// replies no request waits for pushed over the session's event stream. No build step.
(function () {
  "use strict";

  const HISTORY_LIMIT = 50;
  const RENDER_EVERY_MS = 80; // re-render a growing reply at most this often
  // After Stop, how long the reply may take to end (stopped, what was shown kept) before
  // the page stops reading it instead (nothing was running to stop, or the gateway is away).
  const STOP_GRACE_MS = 5000;
  const HIGHLIGHT_MAX_CHARS = 100000; // longer code stays plain: highlighting it would stall the page
  const ALIGNMENTS = new Set(["left", "center", "right"]);
  const SESSION_NAME = /^[A-Za-z0-9_.@-]{1,64}$/;

  const $ = (id) => document.getElementById(id);
  const log = $("log"), form = $("form"), text = $("text"), send = $("send");
  const working = $("working"), workingText = $("working-text"), stop = $("stop");
  const session = $("session"), token = $("token"), who = $("who"), welcome = $("welcome");
  const settings = $("settings"), settingsToggle = $("settings-toggle"), refresh = $("refresh");
  const newChat = $("new-chat");

  session.value = localStorage.getItem("gw.session") || session.value;
  token.value = localStorage.getItem("gw.token") || "";

  // -- Markdown ---------------------------------------------------------------------

  marked.use({ gfm: true, breaks: true });
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });

  // Replies are untrusted: parsed by marked, then everything that could run or load
  // script removed by DOMPurify (the page's Content-Security-Policy is the second wall).
  function renderMarkdown(el, source) {
    const html = marked.parse(source);
    const fragment = DOMPurify.sanitize(html, {
      RETURN_DOM_FRAGMENT: true, ADD_ATTR: ["target", "align"],
      FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select"],
    });
    // A table column's alignment (`:-:`, `--:`) comes as `align`, which the stylesheet's
    // cell rule would override: a class says it instead (inline styles are not allowed).
    for (const cell of fragment.querySelectorAll("[align]")) {
      const align = cell.getAttribute("align").toLowerCase();
      cell.removeAttribute("align");
      if ((cell.tagName === "TD" || cell.tagName === "TH") && ALIGNMENTS.has(align)) cell.classList.add("align-" + align);
    }
    for (const pre of fragment.querySelectorAll("pre")) decorateCode(pre);
    for (const table of fragment.querySelectorAll("table")) {
      const wrap = document.createElement("div");
      wrap.className = "table";
      table.replaceWith(wrap);
      wrap.appendChild(table);
    }
    el.replaceChildren(fragment);
  }

  // After DOMPurify, on text only: highlight.js escapes what it is given, and its spans are
  // sanitized again all the same (spans with classes, nothing else).
  function highlight(code, lang) {
    if (!window.hljs || !lang || !hljs.getLanguage(lang)) return;
    const source = code.textContent;
    if (source.length > HIGHLIGHT_MAX_CHARS) return;
    const html = hljs.highlight(source, { language: lang, ignoreIllegals: true }).value;
    code.innerHTML = DOMPurify.sanitize(html, { ALLOWED_TAGS: ["span"], ALLOWED_ATTR: ["class"] });
    code.classList.add("hljs");
  }

  function decorateCode(pre) {
    const code = pre.querySelector("code");
    const lang = code && /language-([\w+#.-]+)/.exec(code.className || "");
    if (lang) highlight(code, lang[1].toLowerCase());
    const box = document.createElement("div");
    box.className = "code";
    const bar = document.createElement("div");
    bar.className = "bar";
    const label = document.createElement("span");
    label.textContent = lang ? lang[1] : "code";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(pre.textContent, copy));
    bar.append(label, copy);
    pre.replaceWith(box);
    box.append(bar, pre);
  }

  async function copyText(value, button) {
    try {
      if (navigator.clipboard && window.isSecureContext) {
        await navigator.clipboard.writeText(value);
      } else { // plain http off loopback: no Clipboard API
        const area = document.createElement("textarea");
        area.value = value;
        document.body.appendChild(area);
        area.select();
        document.execCommand("copy");
        area.remove();
      }
      button.textContent = "Copied";
    } catch (err) {
      button.textContent = "Copy failed";
    }
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  }

  // -- the log ----------------------------------------------------------------------

  function nearBottom() {
    return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  }

  function scrollDown(force) {
    if (force || nearBottom()) log.scrollTop = log.scrollHeight;
  }

  function addMessage(kind, body, at, command) {
    const stick = nearBottom();
    const div = document.createElement("div");
    div.className = "msg " + kind + (command ? " command" : "");
    if (kind === "bot") renderMarkdown(div, body);
    else div.textContent = body; // the person's own text and errors: never HTML
    if (at) div.title = new Date(at * 1000).toLocaleString();
    log.appendChild(div);
    scrollDown(stick);
    return div;
  }

  function addNote(body) {
    const p = document.createElement("p");
    p.className = "note";
    p.textContent = body;
    log.appendChild(p);
    scrollDown(true);
  }

  // Where a fresh context started (/new, /context clear): what comes after it is a new
  // conversation for the model.
  function addDivider(at) {
    const div = document.createElement("div");
    div.className = "divider";
    div.setAttribute("role", "separator");
    const label = document.createElement("span");
    label.textContent = "new conversation";
    div.appendChild(label);
    if (at) div.title = new Date(at * 1000).toLocaleString();
    log.appendChild(div);
    scrollDown(true);
  }

  // A reply pushed over the event stream: before a reply being written now, if any.
  function addPushed(data) {
    const pending = log.querySelector(".msg.bot.pending");
    const div = addMessage(data.failed ? "error" : "bot", data.text, data.at);
    if (pending) log.insertBefore(div, pending);
    pushes += 1;
    lastPushed.push([pushes, data]);
    if (lastPushed.length > 20) lastPushed.shift();
    shownHistory = ""; // the log has changed since the last history load
    scrollDown(!pending);
  }

  function clearLog() {
    log.replaceChildren(welcome);
  }

  function showWho() {
    who.textContent = "session: " + session.value;
    welcome.textContent = "Chat with the gateway as \u201c" + session.value + "\u201d. Conversations are kept on "
      + "the gateway, so earlier messages and replies that arrived while this page was closed show here.";
  }

  function authHeaders(extra) {
    const headers = Object.assign({}, extra);
    if (token.value) headers["Authorization"] = "Bearer " + token.value;
    return headers;
  }

  // -- history ----------------------------------------------------------------------

  let shownHistory = ""; // what the last history load showed, to skip redrawing the same
  // Replies pushed so far, and the last few: a history load that began before one came
  // may not hold it yet, so it is shown again after what the load draws.
  let pushes = 0;
  const lastPushed = [];
  let needsToken = false; // the gateway said 401: nothing is retried until a token is entered

  async function loadHistory(force) {
    if (busy) return;
    const pushed = pushes;
    let res, data;
    try {
      const url = "api/history?session=" + encodeURIComponent(session.value) + "&limit=" + HISTORY_LIMIT;
      res = await fetch(url, { headers: authHeaders(), cache: "no-store" });
      data = await res.json().catch(() => ({}));
    } catch (err) {
      clearLog();
      addMessage("error", "The gateway could not be reached: " + err.message);
      return;
    }
    if (busy) return;
    needsToken = res.status === 401;
    if (!res.ok || !Array.isArray(data.messages)) {
      clearLog();
      shownHistory = "";
      if (res.status === 401) showHowToGetIn();
      else {
        addMessage("error", data.error || "the history could not be loaded (HTTP " + res.status + ")");
      }
      return;
    }
    const key = JSON.stringify(data.messages);
    if (!force && key === shownHistory) return;
    shownHistory = key;
    clearLog();
    // `before` is set when older messages exist (a page holds at most HISTORY_LIMIT, and less when they are long).
    if (data.before) addNote("Showing the last " + data.messages.length + " messages.");
    for (const m of data.messages) {
      if (m.kind === "divider") addDivider(m.at);
      else addMessage(m.role === "user" ? "user" : "bot", m.text, m.at, m.kind === "command");
    }
    for (const [n, p] of lastPushed) {
      if (n > pushed && !data.messages.some((m) => m.role === "assistant" && m.text === p.text)) {
        addMessage(p.failed ? "error" : "bot", p.text, p.at);
      }
    }
    scrollDown(true);
  }

  // Refused for want of the token (SPEC §9): the page signs in through the gateway's link.
  function showHowToGetIn() {
    const box = addMessage("error signin", "");
    const lines = [
      ["This page needs the gateway's link to sign in: open the address ", "gateway run", " printed when it started (",
       location.origin + "/?token=\u2026", ")."],
      ["To print it again: ", "python -m gateway web-link", "."],
      ["With channels.web.token set, enter it in the settings (\u2699) instead."],
    ];
    for (const parts of lines) {
      const p = document.createElement("p");
      parts.forEach((part, i) => {
        if (i % 2) {
          const code = document.createElement("code");
          code.textContent = part;
          p.appendChild(code);
        } else p.appendChild(document.createTextNode(part));
      });
      box.appendChild(p);
    }
  }

  // -- sending ----------------------------------------------------------------------

  let busy = false;
  let controller = null;
  let ticker = null;
  let stopping = false; // Stop was pressed for the reply coming in now
  let stopTimer = null;
  let readingId = null; // the message whose reply is being read now
  // A reply can reach its request just as the page stops reading it (Stop, the grace
  // timer): the gateway then says "answered" over the event stream, and the page shows
  // it from the history. The ids the page stopped reading, those the gateway answered
  // lately, and those already caught up this way (a push of one is not shown twice).
  const abandoned = new Set();
  const answeredLately = [];
  const caughtUp = [];

  function setWorking(on) {
    busy = on;
    send.disabled = on;
    newChat.disabled = on;
    working.hidden = !on;
    stop.disabled = false;
    clearInterval(ticker);
    if (on) {
      const started = Date.now();
      workingText.textContent = "working\u2026 0 s";
      ticker = setInterval(() => {
        workingText.textContent = "working\u2026 " + Math.floor((Date.now() - started) / 1000) + " s";
      }, 1000);
    }
  }

  function newId() {
    if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
    return Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 12);
  }

  // One reply as it grows: the text so far (or a tool status that replaced it),
  // re-rendered at most every RENDER_EVERY_MS.
  function liveReply() {
    const div = addMessage("bot pending", "");
    div.hidden = true; // the working line speaks until there is something to show
    let answer = "", status = "", timer = null, last = 0;
    function draw() {
      timer = null;
      last = Date.now();
      const stick = nearBottom();
      div.hidden = false;
      if (answer) renderMarkdown(div, answer);
      else {
        const line = document.createElement("span");
        line.className = "status";
        line.textContent = status;
        div.replaceChildren(line);
      }
      scrollDown(stick);
    }
    function schedule() {
      if (timer === null) timer = setTimeout(draw, Math.max(0, RENDER_EVERY_MS - (Date.now() - last)));
    }
    return {
      delta(t) { answer += t; schedule(); },
      status(line) { answer = ""; status = line; schedule(); },
      done(reply) {
        clearTimeout(timer);
        div.className = stopping ? "msg bot stopped" : "msg bot";
        div.hidden = false;
        renderMarkdown(div, reply);
        div.title = new Date().toLocaleString();
        scrollDown(true);
      },
      drop() { clearTimeout(timer); div.remove(); },
      shown() { return answer !== "" || status !== ""; },
    };
  }

  // A tool waiting for a yes (SPEC §5.7): the whole arguments and Allow / Deny.
  const cards = new Map();

  function approvalCard(data) {
    const stick = nearBottom();
    const card = document.createElement("div");
    card.className = "msg approval";
    const title = document.createElement("div");
    title.className = "approval-title";
    title.textContent = "Approval needed: " + data.tool;
    const args = document.createElement("pre");
    args.className = "approval-args";
    args.textContent = data.arguments; // whole, never cut nor folded; escapes visible (the server's)
    // The workspace files the command names (a script it runs), each with its text when short.
    const files = document.createElement("div");
    files.className = "approval-files";
    if ((data.files || []).length) {
      const intro = document.createElement("div");
      intro.textContent = "The command names these workspace files:";
      files.append(intro);
    }
    for (const file of data.files || []) {
      const heading = document.createElement("div");
      heading.className = "approval-file";
      heading.textContent = file.heading;
      files.append(heading);
      if (typeof file.text === "string") {
        const text = document.createElement("pre");
        text.className = "approval-args";
        text.textContent = file.text;
        files.append(text);
      }
    }
    const note = document.createElement("div");
    note.className = "approval-note";
    note.textContent = "Who may answer: " + data.who + ". No answer in " + data.timeout_s + " s is a deny.";
    const buttons = document.createElement("div");
    buttons.className = "approval-buttons";
    const allow = document.createElement("button");
    allow.type = "button";
    allow.textContent = "Allow";
    allow.className = "allow";
    const deny = document.createElement("button");
    deny.type = "button";
    deny.textContent = "Deny";
    for (const [button, decision] of [[allow, "allow"], [deny, "deny"]]) {
      button.addEventListener("click", () => answerApproval(data.id, decision, card));
    }
    buttons.append(allow, deny);
    card.append(title, args, files, note, buttons);
    log.append(card);
    cards.set(data.id, card);
    scrollDown(stick);
  }

  async function answerApproval(id, decision, card) {
    const buttons = card.querySelectorAll("button");
    buttons.forEach((b) => { b.disabled = true; });
    try {
      const res = await fetch("api/approvals/" + encodeURIComponent(id), {
        method: "POST",
        headers: authHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify({ session: session.value, decision: decision }),
      });
      const data = await res.json().catch(() => ({ error: "unreadable answer (HTTP " + res.status + ")" }));
      if (card.classList.contains("decided")) return; // the outcome came first and says it all
      card.querySelector(".approval-note").textContent = data.notice || data.error || ("HTTP " + res.status);
      if (!res.ok || !/^(Allowed|Denied)\./.test(data.notice || "")) buttons.forEach((b) => { b.disabled = false; });
    } catch (err) {
      card.querySelector(".approval-note").textContent = "Could not answer: " + err.message;
      buttons.forEach((b) => { b.disabled = false; });
    }
  }

  function settleCard(data) {
    const card = cards.get(data.id);
    if (!card) return;
    card.querySelectorAll("button").forEach((b) => { b.disabled = true; });
    card.querySelector(".approval-note").textContent = data.outcome;
    card.classList.add("decided");
    cards.delete(data.id);
  }

  // Server-Sent Events from a fetch body (EventSource cannot POST, nor send a token);
  // `onField` sees the `id` and `retry` fields.
  async function readEvents(res, onEvent, onField) {
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (!line || line.startsWith(":")) continue; // comments are heartbeats
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let val = colon < 0 ? "" : line.slice(colon + 1);
          if (val.startsWith(" ")) val = val.slice(1);
          if (field === "event") event = val;
          else if (field === "data") data.push(val);
          else if (onField && (field === "id" || field === "retry")) onField(field, val);
        }
        if (data.length && onEvent(event, JSON.parse(data.join("\n")))) return;
      }
    }
  }

  function submit() {
    const message = text.value.trim();
    if (!message || busy || !sessionNameOk()) return;
    text.value = "";
    fitText();
    converse(message);
  }

  function sessionNameOk() {
    if (SESSION_NAME.test(session.value)) return true;
    openSettings(true);
    addMessage("error", "The session name must be 1-64 letters, digits, _ . @ or -.");
    return false;
  }

  function abandon(reading, id) {
    if (id) abandoned.add(id);
    reading.abort();
  }

  function catchUp() {
    for (const id of abandoned) {
      if (!answeredLately.includes(id)) continue;
      abandoned.delete(id);
      caughtUp.push(id);
      if (caughtUp.length > 20) caughtUp.shift();
      loadHistory(true);
      return;
    }
  }

  // One message and its reply.
  async function converse(message) {
    addMessage("user", message);
    scrollDown(true);
    setWorking(true);
    controller = new AbortController();
    const id = newId();
    readingId = id;
    const reply = liveReply();
    let finished = false;
    try {
      const res = await fetch("api/chat", {
        method: "POST",
        headers: authHeaders({ "Content-Type": "application/json", "Accept": "text/event-stream" }),
        body: JSON.stringify({ session: session.value, text: message, id: id, stream: true }),
        signal: controller.signal,
      });
      const type = res.headers.get("Content-Type") || "";
      if (res.ok && type.startsWith("text/event-stream")) {
        await readEvents(res, (event, data) => {
          if (event === "delta") reply.delta(data.text);
          else if (event === "status") reply.status(data.text);
          else if (event === "approval") approvalCard(data);
          else if (event === "approval_done") settleCard(data);
          else if (event === "done") { reply.done(data.reply); finished = true; }
          else if (event === "error") { reply.drop(); addMessage("error", data.error); finished = true; }
          return finished;
        });
        if (!finished) {
          reply.drop();
          addMessage("error", "The connection closed before the reply was complete; it will show in the "
            + "history (\u21bb) once the gateway has answered.");
        }
      } else {
        // Refused before any answer (bad token, busy, too long…), or an older gateway's JSON.
        const data = await res.json().catch(() => ({ error: "unreadable answer (HTTP " + res.status + ")" }));
        if (res.ok && typeof data.reply === "string") reply.done(data.reply);
        else if (res.status === 401) { reply.drop(); showHowToGetIn(); }
        else { reply.drop(); addMessage("error", data.error || "HTTP " + res.status); }
      }
    } catch (err) {
      reply.drop();
      if (err.name === "AbortError") {
        addNote("Stopped waiting. The gateway still finishes this turn; its reply will show in the "
          + "history (\u21bb).");
      } else {
        addMessage("error", "The gateway could not be reached: " + err.message);
      }
    } finally {
      controller = null;
      readingId = null;
      stopping = false;
      clearTimeout(stopTimer);
      setWorking(false);
      shownHistory = ""; // the log has changed since the last history load
      text.focus();
      catchUp();
    }
    // A command's answer: the history shows it as the gateway kept it, with a divider
    // where it started a fresh context.
    if (message.startsWith("/")) loadHistory(true);
  }

  // -- replies no request of this page waits for ------------------------------------
  // A scheduled task's reply, or one that came after Stop: the session's event
  // stream. EventSource reconnects by itself (after the stream's `retry`, sending
  // Last-Event-ID, so nothing is missed); it cannot send a token, so with one the same
  // protocol is read from fetch.

  let following = null;

  function followEvents() {
    if (following) following.stop();
    following = null;
    if (!SESSION_NAME.test(session.value)) return;
    const url = "api/events?session=" + encodeURIComponent(session.value);
    following = token.value ? followWithFetch(url) : followWithEventSource(url);
  }

  function onPushed(event, data) {
    if (event === "reply") {
      if (data.id && caughtUp.includes(data.id)) return; // the history load shows it
      if (data.id) abandoned.delete(data.id);
      addPushed(data);
    } else if (event === "answered") {
      answeredLately.push(data.id);
      if (answeredLately.length > 20) answeredLately.shift();
      if (!busy) catchUp();
    } else if (event === "resync") loadHistory(true); // more was missed than the gateway keeps
  }

  function followWithEventSource(url) {
    let source = null, timer = null, stopped = false, opened = false;
    function open() {
      source = new EventSource(url);
      source.addEventListener("open", () => {
        if (!opened) { opened = true; loadHistory(false); } // whatever came before it opened
      });
      for (const name of ["reply", "answered", "resync"]) {
        source.addEventListener(name, (e) => onPushed(name, JSON.parse(e.data)));
      }
      source.addEventListener("error", () => {
        // Closed for good only when refused (starting, too many pages): try again a while
        // later; never without the token the gateway asked for (each try would count as
        // a wrong one).
        if (source.readyState === EventSource.CLOSED && !stopped) {
          timer = setTimeout(() => { if (!needsToken) open(); }, 15000);
        }
      });
    }
    open();
    return { stop() { stopped = true; clearTimeout(timer); source.close(); } };
  }

  function followWithFetch(url) {
    const controller = new AbortController();
    let lastId = "", retry = 3000, opened = false;
    (async () => {
      while (!controller.signal.aborted) {
        let wait = retry;
        try {
          const headers = authHeaders({ "Accept": "text/event-stream" });
          if (lastId) headers["Last-Event-ID"] = lastId;
          const res = await fetch(url, { headers: headers, cache: "no-store", signal: controller.signal });
          if (res.status === 401) return; // the history says so and opens the settings
          if (res.ok) {
            if (!opened) { opened = true; loadHistory(false); }
            await readEvents(res, (event, data) => { onPushed(event, data); return false; }, (field, value) => {
              if (field === "id") lastId = value;
              else if (/^\d+$/.test(value)) retry = Number(value);
            });
          } else {
            wait = Math.max(retry, (Number(res.headers.get("Retry-After")) || 15) * 1000);
          }
        } catch (err) {
          if (controller.signal.aborted) return;
        }
        await new Promise((resolve) => setTimeout(resolve, wait));
      }
    })();
    return { stop() { controller.abort(); } };
  }

  // -- controls ---------------------------------------------------------------------

  function fitText() {
    text.style.height = "auto";
    text.style.height = Math.min(text.scrollHeight + 2, window.innerHeight * 0.4) + "px";
  }

  function openSettings(open) {
    settings.hidden = !open;
    settingsToggle.setAttribute("aria-expanded", String(open));
  }

  function applySettings() {
    if (!SESSION_NAME.test(session.value)) return;
    localStorage.setItem("gw.session", session.value);
    if (token.value) localStorage.setItem("gw.token", token.value);
    else localStorage.removeItem("gw.token");
    showWho();
    loadHistory(true);
    followEvents();
  }

  // Stop is `/stop` (SPEC §6): the gateway stops the turn, and the reply ends with what was
  // shown, marked [stopped]; the next message is answered at once. Should the reply not end
  // (nothing was running yet), the page stops reading it after STOP_GRACE_MS.
  async function stopReply() {
    if (!controller || stopping) return;
    stopping = true;
    stop.disabled = true;
    const reading = controller;
    const id = readingId;
    stopTimer = setTimeout(() => abandon(reading, id), STOP_GRACE_MS);
    try {
      const res = await fetch("api/chat", {
        method: "POST",
        headers: authHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify({ session: session.value, text: "/stop", id: newId() }),
      });
      if (!res.ok) abandon(reading, id);
    } catch (err) {
      abandon(reading, id);
    }
  }

  stop.addEventListener("click", stopReply);
  form.addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  text.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  text.addEventListener("input", fitText);
  settingsToggle.addEventListener("click", () => openSettings(settings.hidden));
  session.addEventListener("change", applySettings);
  token.addEventListener("change", applySettings);
  refresh.addEventListener("click", () => loadHistory(true));
  newChat.addEventListener("click", () => { if (!busy && sessionNameOk()) converse("/new"); });
  // Replies that came in while the tab was in the background.
  document.addEventListener("visibilitychange", () => { if (!document.hidden) loadHistory(false); });

  if (window.matchMedia("(max-width: 520px)").matches) text.placeholder = "Message"; // the hint does not fit

  showWho();
  loadHistory(true);
  followEvents();
  text.focus();
})();
