"""The server's Prometheus metrics (its own registry, text format at GET /metrics).

  dgr2_queue_depth{mode}                     requests waiting for a slot
  dgr2_slot_occupancy{mode}                  busy slots / slots (0..1)
  dgr2_slots{mode}                           slots of the engine
  dgr2_tokens_per_second{mode}               output tokens per second of decode time, since start
  dgr2_generated_tokens_total{mode}          output tokens of finished requests (rate() = tokens/s)
  dgr2_request_latency_seconds{endpoint,mode}  histogram, arrival to answer
  dgr2_requests_total{endpoint,mode}         answered requests
  dgr2_rejected_requests_total{reason}       bad_json, bad_field, unknown_item, candidate_count,
                                             too_large, queue_full, deadline, client_gone,
                                             not_ready, shutting_down, not_found, bad_method, internal
  dgr2_row_iterations_total{mode}, dgr2_busy_row_iterations_total{mode},
  dgr2_wasted_row_iterations_total{mode}     the engine's slot-iterations (engine.py)
  dgr2_rounds_total{mode}                    engine rounds (host round trips)
  dgr2_queue_seconds_total{mode}, dgr2_service_seconds_total{mode}
                                             finished requests' time waiting for a slot / decoding
  dgr2_finished_requests_total{mode}         requests the engine answered
"""

from __future__ import annotations

import threading

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


class _EngineCollector:
  """Reads the engines' state and counters at scrape time."""

  def __init__(self, get_service):
    self.get_service = get_service

  def collect(self):
    svc = self.get_service()
    engines = svc.engines if svc is not None else {}
    fams = dict(
        queue=GaugeMetricFamily("dgr2_queue_depth", "requests waiting for a slot", labels=["mode"]),
        occ=GaugeMetricFamily("dgr2_slot_occupancy", "busy slots / slots", labels=["mode"]),
        slots=GaugeMetricFamily("dgr2_slots", "slots of the engine", labels=["mode"]),
        tps=GaugeMetricFamily("dgr2_tokens_per_second", "output tokens per second of decode time", labels=["mode"]),
        tokens=CounterMetricFamily("dgr2_generated_tokens", "output tokens of finished requests", labels=["mode"]),
        rows=CounterMetricFamily("dgr2_row_iterations", "slots x decode iterations", labels=["mode"]),
        busy=CounterMetricFamily("dgr2_busy_row_iterations", "slot-iterations that decoded", labels=["mode"]),
        wasted=CounterMetricFamily("dgr2_wasted_row_iterations", "idle slot-iterations while requests waited",
                                   labels=["mode"]),
        rounds=CounterMetricFamily("dgr2_rounds", "engine rounds (host round trips)", labels=["mode"]),
        queue_s=CounterMetricFamily("dgr2_queue_seconds", "finished requests' seconds waiting for a slot",
                                    labels=["mode"]),
        service_s=CounterMetricFamily("dgr2_service_seconds", "finished requests' seconds decoding", labels=["mode"]),
        finished=CounterMetricFamily("dgr2_finished_requests", "requests the engine answered", labels=["mode"]))
    for mode, eng in engines.items():
      st = eng.stats
      fams["queue"].add_metric([mode], eng.queue_depth())
      fams["occ"].add_metric([mode], eng.occupancy() / eng.slots)
      fams["slots"].add_metric([mode], eng.slots)
      fams["tps"].add_metric([mode], st.tokens / st.decode_seconds if st.decode_seconds else 0.0)
      fams["tokens"].add_metric([mode], st.tokens)
      fams["rows"].add_metric([mode], st.row_iterations)
      fams["busy"].add_metric([mode], st.busy_row_iterations)
      fams["wasted"].add_metric([mode], st.wasted_row_iterations)
      fams["rounds"].add_metric([mode], st.rounds)
      fams["queue_s"].add_metric([mode], st.queue_seconds)
      fams["service_s"].add_metric([mode], st.service_seconds)
      fams["finished"].add_metric([mode], st.finished)
    yield from fams.values()


class Metrics:
  def __init__(self, get_service):
    self.registry = prom.CollectorRegistry()
    self.lock = threading.Lock()
    self.latency = prom.Histogram("dgr2_request_latency_seconds", "arrival to answer", ["endpoint", "mode"],
                                  buckets=LATENCY_BUCKETS, registry=self.registry)
    self.requests = prom.Counter("dgr2_requests", "answered requests", ["endpoint", "mode"], registry=self.registry)
    self.rejected = prom.Counter("dgr2_rejected_requests", "rejected requests by reason", ["reason"],
                                 registry=self.registry)
    self.registry.register(_EngineCollector(get_service))

  def observe(self, endpoint: str, mode: str, seconds: float):
    self.latency.labels(endpoint, mode).observe(seconds)
    self.requests.labels(endpoint, mode).inc()

  def reject(self, reason: str):
    self.rejected.labels(reason).inc()

  def render(self):
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
