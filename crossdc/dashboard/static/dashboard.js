// crossdc dashboard: draw the page's plotly figures; keep a running run's page live.
//
// A page carries its figures as JSON in <script id="figures-data"> ({div id: {data, layout}}).
// A run page also carries <script id="live-data"> ({url, version, running, interval_ms}):
// while the run runs, it asks url?version=V every interval_ms; when the answer says
// "changed", it redraws the figures with Plotly.react and swaps the page fragments
// (headline, tables) in place, without a reload (unless the answer brings a chart the page
// does not have yet: then it reloads once). It stops once the run stops running.
(function () {
  "use strict";

  var PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] };
  // State, readable by tests and curious operators: window.crossdc.
  var state = (window.crossdc = { version: null, polling: false, updates: 0, errors: 0, lastChecked: null });

  function readJson(id) {
    var el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  }

  // plotly.py writes numpy arrays as {dtype, bdata} (base64). Decode them into typed arrays
  // before plotting, so every trace's x/y is a plain array-like in the div's .data.
  var TYPED = { i1: Int8Array, u1: Uint8Array, i2: Int16Array, u2: Uint16Array,
                i4: Int32Array, u4: Uint32Array, f4: Float32Array, f8: Float64Array };

  function decode(value) {
    if (Array.isArray(value)) return value.map(decode);
    if (value === null || typeof value !== "object") return value;
    if (typeof value.bdata === "string" && TYPED[value.dtype] && !value.shape) {
      var raw = atob(value.bdata), bytes = new Uint8Array(raw.length);
      for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
      return new TYPED[value.dtype](bytes.buffer);
    }
    var out = {};
    Object.keys(value).forEach(function (key) { out[key] = decode(value[key]); });
    return out;
  }

  function draw(figures, react) {
    Object.keys(figures).forEach(function (id) {
      var el = document.getElementById(id);
      if (!el) return;
      var fig = decode(figures[id]);
      (react ? Plotly.react : Plotly.newPlot)(el, fig.data, fig.layout, PLOT_CONFIG);
    });
  }

  function apply(update) {
    // A chart the page has no place for yet (an asynchronous run's staleness charts, once it has staleness):
    // load the page again to lay it out.
    if (update.figures && Object.keys(update.figures).some(function (id) { return !document.getElementById(id); })) {
      window.location.reload();
      return;
    }
    if (update.fragments) {
      Object.keys(update.fragments).forEach(function (id) {
        var el = document.getElementById(id);
        if (el) el.innerHTML = update.fragments[id];
      });
    }
    if (update.figures) draw(update.figures, true);
    state.version = update.version;
    state.updates += 1;
  }

  function stop() {
    state.polling = false;
    var indicator = document.getElementById("live-indicator");
    if (indicator) indicator.hidden = true;
  }

  function poll(live) {
    var url = live.url + "?version=" + encodeURIComponent(state.version || "");
    fetch(url, { cache: "no-store" })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.json();
      })
      .then(function (update) {
        state.lastChecked = Date.now();
        if (update.changed) apply(update);
        if (update.running) {
          setTimeout(function () { poll(live); }, live.interval_ms);
        } else {
          stop();
        }
      })
      .catch(function () {
        // The server may be restarting: keep trying, more slowly.
        state.errors += 1;
        setTimeout(function () { poll(live); }, live.interval_ms * 2);
      });
  }

  function start() {
    var figures = readJson("figures-data");
    if (figures) draw(figures, false);
    var live = readJson("live-data");
    if (!live) return;
    state.version = live.version;
    if (live.running) {
      state.polling = true;
      setTimeout(function () { poll(live); }, live.interval_ms);
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
