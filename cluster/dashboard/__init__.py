"""The live dashboard at ``/dashboard``: one static page (vanilla JS, vendored uPlot) that
polls ``/cluster/stats`` and ``/cluster/decisions`` each second; ``page.install_dashboard``
adds its routes to the ingress's app."""

from cluster.dashboard.page import install_dashboard

__all__ = ["install_dashboard"]
