// crossdc dashboard: draw the page's plotly figures; keep a running run's page live.
//
// A page carries its figures as JSON in <script id="figures-data"> ({div id: {data, layout}}).
// A run page also carries <script id="live-data"> ({url, version, running, interval_ms}):
// while the run runs, it asks url?version=V every interval_ms; when the answer says
// "changed", it redraws the figures with Plotly.react and swaps the page fragments
// (headline, tables) in place, without a reload (unless the answer brings a chart the page
// does not have yet: then it reloads once). It stops once the run stops running.
//
// A pipeline run's page shows one round at a time: picking another in <select id="pipeline-round"> (part of a
// fragment, so it may be replaced) loads the page again at ?round=N, whose live url keeps that round.
//
// A gossip run's page also carries <script id="gossip-data"> ({link_totals_url, rounds_url,
// datacenter_rounds_url, page_size, max_points}): this script reads the JSON API there and draws
// the gossip views itself, with the same Plotly (see "Gossip views" below).
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
    if (gossip.config) refreshGossip();
  }

  function stop() {
    state.polling = false;
    var indicator = document.getElementById("live-indicator");
    if (indicator) indicator.hidden = true;
  }

  function poll(live) {
    var url = live.url + (live.url.indexOf("?") < 0 ? "?" : "&") + "version=" + encodeURIComponent(state.version || "");
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

  // ------------------------------------------------------------ gossip views
  //
  // Two views of a gossip run, drawn from the JSON API:
  // * the topology (#fig-gossip-topology): the datacenters on a circle, in config order, and an edge for
  //   each pair whose link carried exchanges (/api/runs/{id}/link-totals: both directions, over the run),
  //   coloured and labelled by what <select id="topology-colour"> picks: the bytes carried, the RTT the
  //   run's config gives the pair, or the median seconds in flight; a value not known is a grey dotted
  //   edge. Each edge's midpoint tells all of them on hover; the table #gossip-links lists them too.
  // * the consensus curve (#fig-consensus): per round, the replicas' mean distance to their average
  //   (rounds.consensus_distance, trace "mean") and each datacenter's (datacenter_rounds.consensus_distance,
  //   a trace per datacenter), at most max_points points per trace (every k-th, the last kept).
  // The rounds are read once through the API's cursors, then, on each change the live poll brings, only
  // the rounds after the last one read; the link totals (one row per pair) are read whole each time.
  // window.crossdc.gossip counts the loads (loads) and the failed ones (errors).

  var TOPOLOGY_ID = "fig-gossip-topology";
  var CONSENSUS_ID = "fig-consensus";
  // The edges' colour scale, low to high (the same stops the colour bar shows).
  var EDGE_SCALE = [[0, "#fdd49e"], [0.5, "#fc8d59"], [1, "#b30000"]];
  var NOT_KNOWN_COLOR = "#b0b0b0";
  var NODE_COLOR = "#1f77b4";
  var MEAN_COLOR = "#222222";
  // The server-drawn figures' colours and style (crossdc/dashboard/figures.py: _COLORWAY, _figure).
  var COLORWAY = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];
  var FONT = { family: "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", size: 12, color: "#222" };
  // What the topology can colour its edges by: link-totals field → how it is named and written.
  var EDGE_METRICS = {
    bytes: { label: "bytes", format: humanBytes, tick: { tickformat: "~s", ticksuffix: "B" } },
    rtt_ms: { label: "RTT (config)", format: function (ms) { return humanSeconds(ms / 1000); },
              tick: { ticksuffix: " ms" } },
    in_flight_s_median: { label: "in flight (median)", format: humanSeconds, tick: { ticksuffix: " s" } },
  };

  var gossip = (state.gossip = { config: null, loads: 0, errors: 0, busy: false, again: false, colourBy: "bytes",
                                 totals: null, mean: {}, perDatacenter: {}, roundsCursor: null, dcRoundsCursor: null });

  function finiteOrNull(value) {
    return typeof value === "number" && isFinite(value) ? value : null;
  }

  // 1234567 → "1.23 MB" (decimal units, as the pages' `bytes` filter writes them).
  function humanBytes(value) {
    var units = ["B", "kB", "MB", "GB", "TB", "PB"], n = value, i = 0;
    while (i < units.length - 1 && Math.abs(Number(n.toPrecision(3))) >= 1000) { n /= 1000; i += 1; }
    return i === 0 ? Math.round(n) + " B" : Number(n.toPrecision(3)) + " " + units[i];
  }

  // 0.0123 → "12.3 ms", 2.5 → "2.5 s".
  function humanSeconds(value) {
    return value < 1 ? Number((value * 1000).toPrecision(3)) + " ms" : Number(value.toPrecision(3)) + " s";
  }

  // `text` escaped, so that plotly shows it as written: it reads a little HTML (<b>, <br>, <a>) in labels,
  // trace names and tooltips.
  function plain(text) {
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  function orDash(value, format) {
    return value === null || value === undefined ? "–" : format(value);
  }

  // The colour at t (0…1) of EDGE_SCALE, interpolated in RGB as plotly's colour scales are.
  function scaleColor(t) {
    t = Math.max(0, Math.min(1, t));
    for (var i = 1; i < EDGE_SCALE.length; i++) {
      if (t <= EDGE_SCALE[i][0] || i === EDGE_SCALE.length - 1) {
        var lo = EDGE_SCALE[i - 1], hi = EDGE_SCALE[i], f = (t - lo[0]) / (hi[0] - lo[0]);
        var channel = function (k) {
          var a = parseInt(lo[1].substr(1 + 2 * k, 2), 16), b = parseInt(hi[1].substr(1 + 2 * k, 2), 16);
          return Math.round(a + (b - a) * f);
        };
        return "rgb(" + channel(0) + "," + channel(1) + "," + channel(2) + ")";
      }
    }
    return EDGE_SCALE[EDGE_SCALE.length - 1][1];
  }

  // Indices of at most maxPoints of n points, evenly strided, first and last kept (figures.downsample_indices).
  function downsampleIndices(n, maxPoints) {
    var idx = [], i;
    if (n <= maxPoints) {
      for (i = 0; i < n; i++) idx.push(i);
      return idx;
    }
    var stride = Math.ceil((n - 1) / (maxPoints - 1));
    for (i = 0; i < n - 1 && idx.length < maxPoints - 1; i += stride) idx.push(i);
    idx.push(n - 1);
    return idx;
  }

  // An empty layout in the server-drawn figures' style.
  function baseLayout(title) {
    return {
      font: FONT, colorway: COLORWAY, paper_bgcolor: "white", plot_bgcolor: "white", hovermode: "closest",
      margin: { l: 60, r: 30, t: 78, b: 50 },
      legend: { orientation: "h", yanchor: "bottom", y: 1.01, xanchor: "left", x: 0, traceorder: "normal" },
      title: { text: title, x: 0.01, xanchor: "left", xref: "container", y: 0.97, yanchor: "top", yref: "container",
               font: { size: 14 } },
    };
  }

  function note(layout, text) {
    layout.annotations = [{ text: text, x: 0.5, y: 0.5, xref: "paper", yref: "paper", showarrow: false,
                            font: { size: 14, color: "#777" }, name: "empty" }];
    return layout;
  }

  // The topology figure of a link-totals answer, its edges coloured by the field `metric`.
  function topologyFigure(totals, metric) {
    var spec = EDGE_METRICS[metric], names = totals.datacenters.slice(), position = {};
    totals.items.forEach(function (item) {
      [item.a, item.b].forEach(function (name) { if (names.indexOf(name) < 0) names.push(name); });
    });
    names.forEach(function (name, i) {  // clockwise from the top, in config order
      var angle = Math.PI / 2 - (2 * Math.PI * i) / names.length;
      position[name] = [Math.cos(angle), Math.sin(angle)];
    });
    var values = totals.items.map(function (item) { return finiteOrNull(item[metric]); });
    var highest = Math.max.apply(null, [0].concat(values.filter(function (v) { return v !== null; }))) || 1;
    var data = totals.items.map(function (item, i) {
      var a = position[item.a], b = position[item.b], known = values[i] !== null;
      return { type: "scatter", mode: "lines", name: plain(item.a + " – " + item.b), x: [a[0], b[0]], y: [a[1], b[1]],
               line: { color: known ? scaleColor(values[i] / highest) : NOT_KNOWN_COLOR, width: 5,
                       dash: known ? "solid" : "dot" },
               hoverinfo: "skip", showlegend: false, legendgroup: "links" };
    });
    // The edges' midpoints: their labels, their tooltips and the colour bar; those with no value in a trace of their own.
    [true, false].forEach(function (withValue) {
      var picked = totals.items.map(function (item, i) { return i; })
        .filter(function (i) { return (values[i] !== null) === withValue; });
      if (!picked.length) return;
      var trace = {
        type: "scatter", mode: "markers+text", name: withValue ? "links" : "links, " + spec.label + " not known",
        legendgroup: "links", showlegend: false, textposition: "top center", textfont: { size: 11 },
        x: [], y: [], text: [], hovertext: [], hoverinfo: "text", customdata: [],
        marker: { size: 12, line: { color: "white", width: 1 } },
      };
      picked.forEach(function (i) {
        var item = totals.items[i], a = position[item.a], b = position[item.b];
        trace.x.push((a[0] + b[0]) / 2);
        trace.y.push((a[1] + b[1]) / 2);
        trace.text.push(orDash(values[i], spec.format));
        trace.customdata.push([item.a, item.b, item.bytes]);
        var first = plain(item.a), second = plain(item.b);
        trace.hovertext.push(
          "<b>" + first + " – " + second + "</b><br>" +
          humanBytes(item.bytes) + " over the run (" + first + " → " + second + " " + humanBytes(item.bytes_a_to_b) +
          ", " + second + " → " + first + " " + humanBytes(item.bytes_b_to_a) + ")<br>" +
          item.rounds + " rounds, " + item.failed_rounds + " failed<br>" +
          "RTT (config): " + orDash(item.rtt_ms, EDGE_METRICS.rtt_ms.format) +
          (item.route ? (item.route === "direct" ? ", direct link" : ", via the coordinator") : "") + "<br>" +
          "in flight (median): " + orDash(item.in_flight_s_median, humanSeconds));
      });
      if (withValue) {
        trace.marker.color = picked.map(function (i) { return values[i]; });
        trace.marker.colorscale = EDGE_SCALE;
        trace.marker.cmin = 0;
        trace.marker.cmax = highest;
        trace.marker.showscale = true;
        trace.marker.colorbar = Object.assign({ title: { text: spec.label, side: "right" }, thickness: 12 }, spec.tick);
      } else {
        trace.marker.color = NOT_KNOWN_COLOR;
      }
      data.push(trace);
    });
    var sent = {}, received = {};
    totals.items.forEach(function (item) {
      sent[item.a] = (sent[item.a] || 0) + item.bytes_a_to_b;
      received[item.b] = (received[item.b] || 0) + item.bytes_a_to_b;
      sent[item.b] = (sent[item.b] || 0) + item.bytes_b_to_a;
      received[item.a] = (received[item.a] || 0) + item.bytes_b_to_a;
    });
    data.push({
      type: "scatter", mode: "markers+text", name: "datacenters", showlegend: false,
      x: names.map(function (name) { return position[name][0]; }),
      y: names.map(function (name) { return position[name][1]; }),
      text: names.map(plain), textposition: names.map(function (name) { return labelPosition(position[name]); }),
      marker: { size: 20, color: NODE_COLOR, line: { color: "white", width: 2 } },
      hovertext: names.map(function (name) {
        return "<b>" + plain(name) + "</b><br>sent " + humanBytes(sent[name] || 0) + ", received " +
               humanBytes(received[name] || 0) + " on its links";
      }),
      hoverinfo: "text",
    });
    var layout = baseLayout("Topology: links coloured by " + spec.label);
    layout.xaxis = { visible: false, range: [-1.6, 1.6], fixedrange: true };
    layout.yaxis = { visible: false, range: [-1.35, 1.35], scaleanchor: "x", fixedrange: true };
    layout.margin = { l: 20, r: 20, t: 50, b: 20 };
    if (!totals.items.length) note(layout, "no gossip exchange logged yet");
    return { data: data, layout: layout };
  }

  // Where a node's name goes: away from the circle's centre, so that it crosses none of the node's edges.
  function labelPosition(xy) {
    if (xy[1] > 0.5) return "top center";
    if (xy[1] < -0.5) return "bottom center";
    return xy[0] >= 0 ? "middle right" : "middle left";
  }

  // Sorted rounds and their values of {round: value}, thinned to at most maxPoints.
  function series(byRound, maxPoints) {
    var rounds = Object.keys(byRound).map(Number).sort(function (a, b) { return a - b; });
    var idx = downsampleIndices(rounds.length, maxPoints);
    return { x: idx.map(function (i) { return rounds[i]; }), y: idx.map(function (i) { return byRound[rounds[i]]; }) };
  }

  // The consensus curve: the mean distance per round, then one trace per datacenter (by name).
  function consensusFigure(mean, perDatacenter, maxPoints) {
    var data = [], all = [];
    function add(name, byRound, color, width) {
      var s = series(byRound, maxPoints);
      if (!s.x.length) return;
      all = all.concat(s.y);
      data.push({ type: "scatter", name: name, x: s.x, y: s.y, mode: s.x.length <= 60 ? "lines+markers" : "lines",
                  line: { color: color, width: width },
                  hovertemplate: name + "<br>round %{x}<br>distance %{y:.4g}<extra></extra>" });
    }
    add("mean", mean, MEAN_COLOR, 3);
    Object.keys(perDatacenter).sort().forEach(function (name, i) {
      add(plain(name), perDatacenter[name], COLORWAY[i % COLORWAY.length], 1.5);
    });
    var layout = baseLayout("Consensus distance (replica to the replicas' average)");
    var rounds = data.length ? data[0].x : [];
    layout.xaxis = { title: { text: "round" }, gridcolor: "#ececec", zerolinecolor: "#d0d0d0", linecolor: "#999",
                     automargin: true };
    if (rounds.length && rounds[rounds.length - 1] - rounds[0] <= 12) {
      layout.xaxis.dtick = 1;
      layout.xaxis.tickformat = "d";
    }
    // Gossip shrinks the distance geometrically: a log axis shows that as a line (when every value is above 0).
    var positive = all.length && all.every(function (v) { return v > 0; });
    layout.yaxis = { title: { text: "consensus distance (L2)" }, type: positive ? "log" : "linear",
                     gridcolor: "#ececec", zerolinecolor: "#d0d0d0", linecolor: "#999", automargin: true };
    if (positive) layout.yaxis.dtick = "D2";  // within a decade, label 2 and 5 only
    if (!data.length) {
      note(layout, "no consensus distance logged yet");
      layout.xaxis.visible = false;
      layout.yaxis.visible = false;
    }
    return { data: data, layout: layout };
  }

  function fillLinksTable(totals) {
    var body = document.querySelector("#gossip-links tbody");
    if (!body) return;
    var rows = totals.items.map(function (item) {
      var tr = document.createElement("tr");
      tr.dataset.a = item.a;
      tr.dataset.b = item.b;
      var cells = [
        [item.a + " – " + item.b, ""],
        [item.route === "direct" ? "direct" : item.route === "coordinator" ? "via coordinator" : "–", ""],
        [orDash(item.rtt_ms, EDGE_METRICS.rtt_ms.format), "num"],
        [humanBytes(item.bytes), "num"],
        [humanBytes(item.bytes_a_to_b), "num"],
        [humanBytes(item.bytes_b_to_a), "num"],
        [String(item.rounds), "num"],
        [String(item.failed_rounds), item.failed_rounds ? "num bad" : "num"],
        [orDash(item.in_flight_s_median, humanSeconds), "num"],
      ];
      cells.forEach(function (cell) {
        var td = document.createElement("td");
        td.textContent = cell[0];
        if (cell[1]) td.className = cell[1];
        tr.appendChild(td);
      });
      return tr;
    });
    body.replaceChildren.apply(body, rows);
  }

  function drawTopology() {
    var el = document.getElementById(TOPOLOGY_ID);
    if (!el || !gossip.totals) return;
    var fig = topologyFigure(gossip.totals, gossip.colourBy);
    Plotly.react(el, fig.data, fig.layout, PLOT_CONFIG);
  }

  function drawGossip() {
    drawTopology();
    fillLinksTable(gossip.totals);
    var el = document.getElementById(CONSENSUS_ID);
    if (el) {
      var fig = consensusFigure(gossip.mean, gossip.perDatacenter, gossip.config.max_points);
      Plotly.react(el, fig.data, fig.layout, PLOT_CONFIG);
    }
  }

  function getJson(url) {
    return fetch(url, { cache: "no-store" }).then(function (response) {
      if (!response.ok) throw new Error("HTTP " + response.status + " from " + url);
      return response.json();
    });
  }

  // Reads the pages of a cursor-paged series after gossip[cursorKey], handing each page's items to take and
  // moving the cursor on after each page, until the API says there is no more.
  function readPages(url, cursorKey, take) {
    var query = "?limit=" + gossip.config.page_size;
    if (gossip[cursorKey] !== null) query += "&since_round=" + gossip[cursorKey];
    return getJson(url + query).then(function (page) {
      page.items.forEach(take);
      gossip[cursorKey] = page.next_since_round;
      return page.has_more ? readPages(url, cursorKey, take) : null;
    });
  }

  function keep(byRound, round, value) {
    var v = finiteOrNull(value);
    if (v === null) delete byRound[round];
    else byRound[round] = v;
  }

  // Reads what is new and redraws both views; a call while a refresh is under way runs once it ends.
  function refreshGossip() {
    if (gossip.busy) {
      gossip.again = true;
      return;
    }
    gossip.busy = true;
    var config = gossip.config;
    Promise.all([
      getJson(config.link_totals_url).then(function (totals) { gossip.totals = totals; }),
      readPages(config.rounds_url, "roundsCursor", function (row) { keep(gossip.mean, row.round, row.consensus_distance); }),
      readPages(config.datacenter_rounds_url, "dcRoundsCursor", function (row) {
        if (finiteOrNull(row.consensus_distance) === null && !gossip.perDatacenter[row.datacenter]) return;
        gossip.perDatacenter[row.datacenter] = gossip.perDatacenter[row.datacenter] || {};
        keep(gossip.perDatacenter[row.datacenter], row.round, row.consensus_distance);
      }),
    ])
      .then(function () {
        drawGossip();
        gossip.loads += 1;
      })
      .catch(function () { gossip.errors += 1; })
      .then(function () {
        gossip.busy = false;
        if (gossip.again) {
          gossip.again = false;
          refreshGossip();
        }
      });
  }

  function startGossip(config) {
    gossip.config = config;
    var select = document.getElementById("topology-colour");
    if (select) {
      gossip.colourBy = select.value;
      select.addEventListener("change", function () {
        gossip.colourBy = select.value;
        drawTopology();
      });
    }
    refreshGossip();
  }

  // The pipeline's round picker: the page again, at the picked round.
  function pickRound(event) {
    if (!event.target || event.target.id !== "pipeline-round") return;
    var url = new URL(window.location.href);
    url.searchParams.set("round", event.target.value);
    window.location.assign(url.toString());
  }

  function start() {
    document.addEventListener("change", pickRound);
    var figures = readJson("figures-data");
    if (figures) draw(figures, false);
    var gossipConfig = readJson("gossip-data");
    if (gossipConfig) startGossip(gossipConfig);
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
