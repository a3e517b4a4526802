"""The peers' loss code, transcribed (torch, the peer's own padded ``[B, L]`` layout and argument names) as the
references rollshard's corrections must equal: each function cites the repository, commit, file and lines it
follows. Written from the peer's source, not from rollshard's."""
