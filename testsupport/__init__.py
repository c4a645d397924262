"""What the tests, the benches and the scripts share for starting and driving the project's
servers: free ports and the engine (`servers`), docs/deploy.md's commands as written
(`deploy_doc`), a vLLM-Lens server (`vllm_lens`) and a vLLM-like stub upstream (`stub`), and
staff's second factor (`second_factor`: authenticator codes, a test client past it).
Plain Python (no Django at import), for every virtualenv."""
