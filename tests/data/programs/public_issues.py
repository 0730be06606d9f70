"""Programs from public JAX and XLA issues where a user asked why a collective was there, reduced to
``NAME(mesh) -> (fn, args)`` with abstract arguments, as `lab inspect --fn` takes them.

Each keeps its source (the issue's address) and marks the line the maintainers named as the cause with
``# decides``; `CASES` says which cause the lab must name there. The meshes are the lab's axes in place of the
issues' own names (``x`` -> ``fsdp``, ``y`` -> ``tensor``); sizes are the issues' or scaled to 8 devices.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# name -> (issue address, --mesh, cause kind, the op or annotation it names)
CASES = {
    "involuntary_full_remat": (
        "https://github.com/jax-ml/jax/issues/21562 (openxla/xla#15207)",
        "fsdp=4,tensor=2",
        "annotation",
        "with_sharding_constraint",
    ),
    "argsort_of_a_sharded_vector": ("https://github.com/jax-ml/jax/pull/35650", "fsdp=8", "op", "argsort"),
    "fft_along_the_unsharded_axis": (
        "https://github.com/jax-ml/jax/issues/15680 (openxla/xla#24)",
        "fsdp=8",
        "op",
        "fft",
    ),
    "fftn_over_rows": ("https://github.com/jax-ml/jax/issues/13081", "fsdp=8", "op", "fft"),
    "vmapped_fft": ("https://github.com/jax-ml/jax/issues/20683", "fsdp=8", "op", "fft"),
    "transpose_of_split_rows": (
        "https://github.com/mpi4jax/mpi4jax/issues/176 (its all-to-all transpose, as shardings)",
        "fsdp=8",
        "annotation",
        "with_sharding_constraint",
    ),
    "while_loops_of_varying_length": (
        "https://github.com/jax-ml/jax/issues/26586 (and #20968)",
        "data=8",
        "loop predicate",
        "while_loop",
    ),
}


def _abstract(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def involuntary_full_remat(mesh):
    """a + b in one layout, constrained to another: XLA cannot reach it without replicating."""
    one, two = NamedSharding(mesh, P("tensor", None, "fsdp")), NamedSharding(mesh, P(None, ("fsdp", "tensor"), None))

    def f(a, b, c):
        d = a + b
        d = jax.lax.with_sharding_constraint(d, two)  # decides
        return c + d

    fn = jax.jit(f, in_shardings=(one, one, two), out_shardings=two)
    shape = jax.ShapeDtypeStruct((16, 16, 16), jnp.float32)
    return fn, (shape, shape, shape)


def argsort_of_a_sharded_vector(mesh):
    def f(x):
        return jnp.argsort(x)  # decides

    return f, (_abstract(mesh, (1024,), P("fsdp"), jnp.int32),)


def fft_along_the_unsharded_axis(mesh):
    def f(a):
        return jnp.fft.fft(a=a, n=4096, axis=1)  # decides

    return f, (_abstract(mesh, (1024, 1000), P("fsdp", None)),)


def fftn_over_rows(mesh):
    def f(x):
        return jnp.fft.fftn(x, axes=[-1])  # decides

    return f, (_abstract(mesh, (512, 512), P("fsdp", None)),)


def vmapped_fft(mesh):
    def f(x):
        return jax.vmap(jnp.fft.fft)(x)  # decides

    return f, (_abstract(mesh, (16, 1024), P("fsdp")),)


def while_loops_of_varying_length(mesh):
    """Each batch element loops until its own value crosses 2: under vmap the loop runs until every one has."""

    def solve(y0):
        return jax.lax.while_loop(lambda y: y.squeeze() < 2, lambda y: y + 0.1, y0)  # decides

    def f(inits):
        return jax.vmap(solve)(inits)

    return f, (_abstract(mesh, (32, 1), P("data", None)),)


def psum_in_shard_map(mesh):
    """Not from an issue: a collective asked for by name, which the lab must not call a surprise."""

    def f(x):
        return jax.shard_map(lambda v: jax.lax.psum(v, "fsdp"), mesh=mesh, in_specs=P("fsdp"), out_specs=P())(x)

    return f, (_abstract(mesh, (1024,), P("fsdp")),)


def einsum_out_sharding_replicates(mesh):
    """Not from an issue: an einsum whose out_sharding replicates a value the batch splits (explicit axes)."""

    def f(x, w):
        return jnp.einsum("bsd,df->bsf", x, w, out_sharding=P(None, None, None))  # decides

    return f, (_abstract(mesh, (8, 16, 32), P("data", None, None)), _abstract(mesh, (32, 64), P()))


def sum_over_split_rows(mesh):
    """jax-ml/jax#26946: an embedding's 17 rows constrained over 8 devices, then summed over the rows."""

    def f(x):
        embedding = jnp.arange(17 * 16, dtype=jnp.float32).reshape(17, 16) * x
        embedding = jax.lax.with_sharding_constraint(embedding, NamedSharding(mesh, P("data", None)))  # splits
        return embedding.sum(0)  # decides

    return jax.jit(f), (jax.ShapeDtypeStruct((), jnp.float32),)


def row_parallel_matmul(mesh):
    """The scaling book's sharded MLP (jax-ml/scaling-book, jax-stuff.md): the hidden activations constrained to
    split their features over tensor, then contracted with a W_out split the same way."""

    def f(x, w_in, w_out):
        hidden = jnp.einsum("bd,df->bf", x, w_in)
        hidden = jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, P("fsdp", "tensor")))  # splits
        return jnp.einsum("bf,df->bd", hidden, w_out)  # decides

    x = _abstract(mesh, (128, 256), P("fsdp", None), jnp.bfloat16)
    w = _abstract(mesh, (256, 1024), P(None, "tensor"), jnp.bfloat16)
    return jax.jit(f), (x, w, w)


def gradient_returned_whole(mesh):
    """openxla/xla#10543 (from jax-ml/jax#20149): a one-hot target constrained over data against the logits of a
    model whose features data splits; the step returns the model's gradient unsplit."""

    def loss(m, toks):
        logits = jnp.einsum("bld,md->blm", jnp.zeros((32, 128, 32)), m)
        targets = jax.lax.with_sharding_constraint(jax.nn.one_hot(toks, 320), NamedSharding(mesh, P("data", None)))
        return jnp.einsum("bld,bld->bl", targets, logits).mean()

    return jax.jit(jax.value_and_grad(loss)), (
        _abstract(mesh, (320, 32), P(None, "data")),
        _abstract(mesh, (32, 128), P(), jnp.int32),
    )


def flax_logical_constraint(mesh):
    """Not from an issue: a flax linen MLP whose layouts come from logical axis names, the way MaxText writes
    them; the constraint and the matmuls are in flax's code, called from the lines here."""
    import flax.linen as nn

    rules = (("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor"))
    init = nn.initializers.lecun_normal()

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            up = nn.Dense(1024, use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))
            down = nn.Dense(256, use_bias=False, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))
            hidden = nn.with_logical_constraint(nn.relu(up(x)), ("batch", "mlp"))  # splits
            return down(hidden)  # decides

    model = MLP()
    with nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((64, 256))))
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.meta.unbox(boxed), shardings
    )

    def f(params, x):
        with nn.logical_axis_rules(rules):
            return model.apply(params, x)

    return jax.jit(f), (params, _abstract(mesh, (64, 256), P("data", None)))


def pjit_era_gradient(mesh):
    """Not from an issue: code of the pjit era (t5x, early MaxText), bare PartitionSpecs resolved in the mesh in
    context, abstract arguments without shardings; the step returns one gradient, not a tuple."""
    from jax.experimental.pjit import pjit

    def f(x, w):
        return jnp.tanh(x @ w).sum()  # decides

    step = pjit(jax.grad(f, argnums=1), in_shardings=(P("data", None), P(None, "fsdp")), out_shardings=P(None, "fsdp"))
    return step, (jax.ShapeDtypeStruct((64, 128), jnp.float32), jax.ShapeDtypeStruct((128, 256), jnp.float32))


def norm_over_a_split_weight(mesh):
    """Not from an issue: weight normalisation (a norm over the dimension fsdp splits, inside jnp.linalg.norm's own
    jit) before a matmul: the norm's sum is all-reduced every step."""

    def f(w, x):
        w = w / jnp.linalg.norm(w, axis=0, keepdims=True)  # decides
        return x @ w

    return jax.jit(f), (_abstract(mesh, (256, 1024), P("fsdp", None)), _abstract(mesh, (64, 256), P("data", None)))


def an_axis_no_layout_names(mesh):
    """Not from an issue: scanned layers whose weights fsdp splits and whose batch data and fsdp split, on a mesh
    with a tensor axis the program never names; XLA's partitioner shares the matmuls over tensor on its own."""

    def layer(h, w):
        return h + jax.nn.gelu(h @ w["w1"]) @ w["w2"], None  # decides

    def loss(params, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, params)
        return jnp.mean(h**2)

    params = {
        "w1": _abstract(mesh, (4, 256, 1024), P(None, "fsdp", None)),
        "w2": _abstract(mesh, (4, 1024, 256), P(None, None, "fsdp")),
    }
    return jax.jit(jax.value_and_grad(loss)), (params, _abstract(mesh, (32, 256), P(("data", "fsdp"), None)))


def explicit_matmul_then_sum(mesh):
    """The JAX explicit-sharding tutorial's patterns (docs: Explicit sharding): a matmul contracting a dimension
    tensor splits, with an out_sharding=, then a reshard and a sum over the dimension it splits."""

    def f(x, w):
        y = jnp.einsum("bd,df->bf", x, w, out_sharding=P("fsdp", "tensor"))  # decides
        z = jax.sharding.reshard(y, P(None, "fsdp"))
        return jnp.sum(z * 2.0, axis=1)

    return jax.jit(f), (_abstract(mesh, (64, 128), P("fsdp", "tensor")), _abstract(mesh, (128, 256), P("tensor", None)))


def pmap_data_parallel(mesh):
    """The JAX docs' data parallelism with pmap (a pmean of the gradients over the pmapped axis): pmap brings a mesh
    of its own, over its axis name."""

    def step(w, x):
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 1e-3 * jax.lax.pmean(g, axis_name="batch")  # decides

    n = mesh.devices.size
    fn = jax.pmap(step, axis_name="batch", devices=list(mesh.devices.flat))
    return fn, (jax.ShapeDtypeStruct((n, 128, 64), jnp.float32), jax.ShapeDtypeStruct((n, 32, 128), jnp.float32))


def scanned_embedding_gradients(mesh):
    """openxla/xla#49143: embedding gradients accumulated over two micro-batches in lax.scan, the table [96, 35, 256]
    split over its rows and the ids' batch split too; libtpu sums the accumulated gradient once after the loop (its
    while-loop all-reduce code motion, the pass the issue found miscompiling it)."""

    def loss(table, ids, cot):
        return jnp.sum(jnp.tanh(table[ids]) * cot)

    def step(table, ids, cot):
        def micro(acc, xs):
            return acc + jax.grad(loss)(table, *xs), None

        return jax.lax.scan(micro, jnp.zeros_like(table), (ids, cot))[0]  # decides

    table = _abstract(mesh, (96, 35, 256), P("fsdp"))
    return jax.jit(step), (
        table,
        _abstract(mesh, (2, 8), P(None, "fsdp"), jnp.int32),
        _abstract(mesh, (2, 8, 35, 256), P(None, "fsdp")),
    )


def transpose_of_split_rows(mesh):
    """A distributed transpose (a pencil FFT's): rows split, transposed, asked to be split by rows again; the
    transpose alone would leave the result split by columns, so the constraint is what moves it (an all-to-all)."""
    rows = NamedSharding(mesh, P("fsdp", None))

    def f(a):
        return jax.lax.with_sharding_constraint(a.T, rows)  # decides

    return jax.jit(f), (jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=rows),)
