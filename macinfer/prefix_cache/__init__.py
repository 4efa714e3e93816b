"""The prefix cache: full KV blocks named by what their K/V depends on, reused across requests.

    keys.py        block hashes chained from a model identity; hit statistics
    disk.py        the persistent tier: cached blocks as checksummed files, one directory per model
    block_file.py  one block's file: its layout and header, its bytes <-> pool slots
    dirs.py        those directories and the labels that name their model (`macinfer cache`, `rm`)

The in-memory tier is the block pool itself (macinfer.core.block_pool: a freed block keeps its
hash until it is reused); `attach` in macinfer.engine.config turns both tiers on for an engine.
"""
