"""The engines and routers we measure ourselves against, run beside ours."""
