"""hsx's test harness: the pieces the tests and the benchmarks both use (never imported by the product).

    corpora.py     corpus files: JSONL (gzipped, broken lines), Parquet, word prompts
    runs.py        runs written from random samples (write_run, random_samples, Sample), as the connector writes them
    serving.py     ServeProcess: `hsx serve` in a subprocess on a free port, its API key, its logs on failure
    http_proxy.py  LoopbackProxy: an HTTP proxy on loopback that counts, delays or breaks requests
    multinode.py   MultiNodeCluster: a Ray cluster of several nodes on this machine (ray.cluster_utils)
    specs.py       spec_config: the extract_hidden_states speculative_config
"""
