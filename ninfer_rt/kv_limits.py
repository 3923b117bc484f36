"""KV pool sizes the CLIs check at option parsing (kept free of torch so `--help` and bad flags stay fast)."""

PAGE_SIZE = 16                   # tokens per KV page of the serving/generate runtime
# runtime.kv_pages refuses a pool under two pages: the pool is min(--kv-capacity, slots x --max-context),
# so each of the two options must allow at least this many tokens on its own
MIN_KV_TOKENS = 2 * PAGE_SIZE
# prompt prefixes the server keeps by default (--prefix-cache-entries): each holds its full KV pages (from the
# pool) and a copy of the GDN state (one sequence slot's worth)
DEFAULT_PREFIX_ENTRIES = 16
