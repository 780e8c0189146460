// The live view of one taas run (taas_magic/output/widget.py): an anywidget ESM module.
//
// The model's state lives in the kernel, so after a page reload JupyterLab's widget manager
// restores it from there: the header, the run's state and error, the chart (SVG), the status
// lines (health, data) and a snapshot of rank 0's screen (`lines`, `partial`) as of entry
// `seq` of the run log. A view draws that snapshot, then asks the kernel for every entry after
// `seq` ({backlog: seq}); entries also arrive live ({entries: [[seq, stream, text], ...]}).
// Entries are applied strictly in sequence order: one that arrives ahead of a gap waits until
// the backlog fills it, one already applied is ignored. The root element says how far it got
// (data-first-seq, data-last-seq, data-gaps, data-live-at) for the tests that read the page.

const KEEP_LINES = 400;

function makeScreen(lines, partial) {
  return { lines: lines.slice(-KEEP_LINES), partial: partial || "", carriage: false };
}

// Text as a terminal shows it: "\n" ends a line, "\r" starts the line again (tqdm's redraw).
function feed(screen, text) {
  for (const piece of text.split(/(\r\n|\n|\r)/)) {
    if (piece === "\n" || piece === "\r\n") {
      screen.lines.push(screen.partial);
      screen.partial = "";
      screen.carriage = false;
      if (screen.lines.length > KEEP_LINES) screen.lines.splice(0, screen.lines.length - KEEP_LINES);
    } else if (piece === "\r") {
      screen.carriage = true;
    } else if (piece) {
      screen.partial = screen.carriage ? piece : screen.partial + piece;
      screen.carriage = false;
    }
  }
}

function element(tag, className, parent) {
  const node = document.createElement(tag);
  node.className = className;
  parent.appendChild(node);
  return node;
}

function render({ model, el }) {
  const root = element("div", "taas-view", el);
  root.style.cssText = "font-family: var(--jp-code-font-family, monospace); font-size: var(--jp-code-font-size, 12px);";
  const header = element("pre", "taas-view-header", root);
  const status = element("pre", "taas-view-status", root);
  const chart = element("div", "taas-view-chart", root);
  const out = element("pre", "taas-view-out", root);
  const error = element("pre", "taas-view-error", root);
  const foot = element("div", "taas-view-foot", root);
  for (const node of [header, status, out, error]) node.style.cssText = "margin: 0; white-space: pre-wrap;";
  out.style.maxHeight = "24em";
  out.style.overflowY = "auto";
  error.style.color = "var(--jp-error-color1, #d32f2f)";
  foot.style.cssText = "opacity: 0.6; font-size: 0.85em;";

  const screen = makeScreen(model.get("lines"), model.get("partial"));
  let last = model.get("seq");
  let gaps = 0;
  let liveAt = null;
  const waiting = new Map(); // seq -> entry that came ahead of a gap
  root.dataset.run = model.get("run_id");
  root.dataset.firstSeq = String(last + 1);
  root.dataset.gaps = "0";

  function drawOut() {
    const stick = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
    const shown = screen.partial ? screen.lines.concat([screen.partial]) : screen.lines;
    out.textContent = shown.join("\n");
    if (stick) out.scrollTop = out.scrollHeight;
    root.dataset.lastSeq = String(last);
  }
  function drawState() {
    header.textContent = model.get("header");
    const lines = Object.values(model.get("status") || {});
    status.textContent = lines.join("\n");
    const svg = model.get("chart");
    if (chart.dataset.svg !== svg) {
      chart.innerHTML = svg; // drawn by the kernel (output/board.py), its labels escaped there
      chart.dataset.svg = svg;
    }
    error.textContent = (model.get("error") || []).join("\n");
    const state = model.get("state");
    root.dataset.state = state;
    foot.textContent = `taas run ${model.get("run_id")} · ${state} · full log: ${model.get("log_path")}`;
  }
  function apply(entry) {
    const [seq, stream, text] = entry;
    if (stream !== "none" && text) feed(screen, text);
    last = seq;
  }
  function take(entries, fromBacklog) {
    for (const entry of entries) {
      const seq = entry[0];
      if (seq <= last) continue;
      if (seq !== last + 1) {
        waiting.set(seq, entry);
        continue;
      }
      apply(entry);
      while (waiting.has(last + 1)) {
        const next = waiting.get(last + 1);
        waiting.delete(last + 1);
        apply(next);
      }
    }
    if (!fromBacklog && liveAt === null && entries.length) {
      liveAt = performance.now();
      root.dataset.liveAt = String(liveAt);
    }
    drawOut();
  }
  function onMessage(message) {
    if (message.skipped) {
      // entries no longer kept in the kernel (a view away for a very long time): they are on disk
      const [from, to] = message.skipped;
      if (from === last + 1) {
        feed(screen, `[taas] entries ${from}..${to} are in ${model.get("log_path")}\n`);
        last = to;
        gaps += 1;
        root.dataset.gaps = String(gaps);
      }
    }
    if (message.entries) take(message.entries, Boolean(message.backlog));
    if (message.backlog) root.dataset.backlogAt = String(performance.now());
  }
  model.on("msg:custom", onMessage);
  const redraw = () => drawState();
  for (const name of ["header", "status", "chart", "error", "state"]) model.on(`change:${name}`, redraw);
  drawState();
  drawOut();
  model.send({ backlog: last });
  return () => {
    model.off("msg:custom", onMessage);
    for (const name of ["header", "status", "chart", "error", "state"]) model.off(`change:${name}`, redraw);
  };
}

export default { render };
