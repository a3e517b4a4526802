"""The peers' loss code, transcribed in torch as the references rollshard's corrections must equal, each in the
peer's own layout and argument names (TRL and verl: padded ``[B, L]`` with a mask; AReaL: packed ``[T]`` with
``cu_seqlens``; slime and prime-rl: per-sample lists). Each function cites the repository, commit, file and lines
it follows. Written from the peer's source, not from rollshard's."""
