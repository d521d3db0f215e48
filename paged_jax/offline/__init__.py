"""Offline entry points: the `LLM` class (`llm`) and the resumable JSONL batch job (`batch`: its line schema in
`lines`, its output files in `output_files`, its warm-up plan in `plan`, multi-host splitting in `multihost`)."""
