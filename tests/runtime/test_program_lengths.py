"""Which calls get a program of their own, and that each one is said (logger ``autotp``).

A forward that pads the sequence to a chunk and runs chunk by chunk (Gated DeltaNet in Qwen3-Next,
lightning attention in MiniMax, Mamba2's scan) is captured at a dynamic length under the guards
torch.export traced it with (``autotp.capture.export._forced_pin``): a call at another chunk count
breaks them and gets a program of its own, captured, planned and rewritten on first use. Each such
new program is logged once, as a program fixed to one length is (``program.fixed_length``)."""
import logging

import torch


class ChunkedMixer(torch.nn.Module):
    """Gated DeltaNet's torch path in small: the sequence padded to the chunk,
    ``(chunk - s % chunk) % chunk``, reshaped into chunks, a running sum carried chunk to chunk,
    then a projection."""

    def __init__(self, chunk: int = 16, positions: int = 48):
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(vocab_size=16, max_position_embeddings=positions)
        self.chunk = chunk
        self.emb = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids):
        h = self.emb(input_ids)                                                     # (b, s, 8)
        b, s = h.shape[0], h.shape[1]
        pad = (self.chunk - s % self.chunk) % self.chunk
        chunks = torch.nn.functional.pad(h, (0, 0, 0, pad)).reshape(b, -1, self.chunk, 8)   # (b, n, c, 8)
        state, out = torch.zeros_like(chunks[:, 0, 0]), []
        for i in range(chunks.shape[1]):                                            # a loop over the chunks
            out.append(chunks[:, i] + state[:, None])
            state = state + chunks[:, i].sum(1)
        return self.proj(torch.cat(out, 1)[:, :s])                                  # (b, s, 8)


def test_a_call_at_another_chunk_count_gets_its_own_program_and_says_so(fake_rank, caplog):
    import autotp

    model = ChunkedMixer()
    pm = autotp.parallelize(model, 2, example_kwargs={"input_ids": torch.randint(0, 16, (2, 11))})
    assert not pm.capture.fixed_dims and pm.capture.guards   # dynamic in the length, under guards

    def said(length: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="autotp"):
            pm(input_ids=torch.randint(0, 16, (2, length)))
        return [r.getMessage() for r in caplog.records if "breaks the guards" in r.getMessage()]

    assert said(13) == [] and len(pm.programs) == 1   # one chunk, as the example: the captured program
    (line,) = said(20)                                  # two chunks: a new program, said
    assert len(pm.programs) == 2
    assert "input_ids dim 1 = 20 (traced at 11)" in line and "ChunkedMixer's program" in line
    assert "a program of its own" in line and "pad the inputs" in line
    assert said(30) == [] and len(pm.programs) == 2    # two chunks again: the new program serves it
    assert len(said(40)) == 1 and len(pm.programs) == 3   # three chunks: another, said again
