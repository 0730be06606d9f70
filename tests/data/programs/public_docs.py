"""Programs from public documentation (JAX's, Flax's, the scaling book), reduced to ``NAME(mesh) -> (fn, args)``
with abstract arguments, as `lab inspect --fn` takes them: where the lab's reading of why a collective is there has
been wrong before.

Each keeps its source; the meshes use the lab's axes in place of the documents' own names (``stages`` ->
``stage``, ``model`` -> ``tensor``), and sizes are scaled to compile in seconds on 8 CPU devices.
"""

import itertools
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _abstract(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _predict(params, inputs):
    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jnp.maximum(outputs, 0)
    return outputs


def _loss(params, batch):
    inputs, targets = batch
    predictions = _predict(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


# https://docs.jax.dev/en/latest/notebooks/Distributed_arrays_and_automatic_parallelization.html, "4-way batch data
# parallelism and 2-way model tensor parallelism": layer_sizes = [784, 8192, 8192, 8192, 10] and batch_size = 8192
# there, the hidden width equal to the batch; 512 both here
def data_and_tensor_parallel_mlp(mesh):
    """--mesh data=4,tensor=2: one all-reduce of every gradient over data, the activations' over tensor."""
    layer_sizes, batch_size = [784, 512, 512, 512, 10], 512
    specs = [(P(), P()), (P(None, "tensor"), P("tensor")), (P("tensor", None), P()), (P(), P())]
    params = [
        (_abstract(mesh, (n_in, n_out), w), _abstract(mesh, (n_out,), b))
        for (n_in, n_out), (w, b) in zip(itertools.pairwise(layer_sizes), specs)
    ]
    batch = (_abstract(mesh, (batch_size, 784), P("data", None)), _abstract(mesh, (batch_size, 10), P("data", None)))
    return jax.jit(jax.grad(_loss)), (params, batch)


_LAYERS, _BATCH = [784, 128, 128, 128, 128, 128, 8], 32


# https://docs.jax.dev/en/latest/notebooks/shard_map.html, "SPMD pipeline parallelism (PP)": the GPipe loop of
# ppermutes, differentiated
def spmd_pipeline(mesh):
    """--mesh stage=2,data=4: ppermutes asked for by name, stage to stage, forward and backward."""
    L = len(_LAYERS) - 1 - 2  # num layers, excluding first and last
    N = _BATCH
    F = _LAYERS[1]
    S, B = mesh.shape["stage"], 8
    M, ragged = divmod(N, B)
    assert not ragged
    K, ragged = divmod(M, S)
    assert not ragged

    def shift(i, state, inputs, outputs):
        def sh(x, d):
            return jax.lax.ppermute(x, "stage", [(i, (i + d) % S) for i in range(S)])

        state = jnp.roll(state, +1, axis=0).at[0].set(sh(state[-1], +1))
        if (i % K) == (-1 % K):
            inputs = sh(inputs, +1)
        if ((i - L + 1) % K) == (-1 % K):
            outputs = sh(outputs, +1)
        return state, inputs, outputs

    def spmd_pipeline(fn, stage_params, inputs):
        stage = jax.lax.axis_index("stage")
        outputs = jnp.zeros_like(inputs) * jnp.nan
        state = jnp.zeros((L // S, B, F)) * jnp.nan
        for i in range(M + L - 1):
            state = state.at[0].set(jnp.where(stage == 0, inputs[i % K], state[0]))
            state = jax.vmap(fn)(stage_params, state)
            outputs = outputs.at[(i - L + 1) % K].set(jnp.where(stage == S - 1, state[-1], outputs[(i - L + 1) % K]))
            state, inputs, outputs = shift(i, state, inputs, outputs)
        outputs = jax.lax.ppermute(outputs, "stage", [(i, (i + 1) % S) for i in range(S)])
        return outputs

    def _predict_pp(params, inputs):
        (W_first, b_first), inner_params, (W_last, b_last) = params
        inputs = jax.nn.relu(jnp.dot(inputs, W_first) + b_first)
        inputs = spmd_pipeline(lambda Wb, x: jax.nn.relu(x @ Wb[0] + Wb[1]), inner_params, inputs)
        outputs = jnp.dot(inputs, W_last) + b_last
        return outputs

    @partial(jax.shard_map, mesh=mesh, in_specs=((P(), P("stage"), P()), P("stage")), out_specs=P())
    def loss_pp(params, batch):
        inputs, targets = batch
        predictions = _predict_pp(params, inputs.reshape(K, B, -1)).reshape(K * B, -1)
        local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
        return jax.lax.pmean(local_loss, "stage")

    first = (_abstract(mesh, (784, F), P()), _abstract(mesh, (F,), P()))
    stacked = (_abstract(mesh, (L, F, F), P("stage")), _abstract(mesh, (L, F), P("stage")))
    last = (_abstract(mesh, (F, 8), P()), _abstract(mesh, (8,), P()))
    batch = (_abstract(mesh, (N, 784), P("stage")), _abstract(mesh, (N, 8), P("stage")))
    return jax.jit(jax.grad(loss_pp)), ((first, stacked, last), batch)


# https://github.com/jax-ml/scaling-book (training.md, ZeRO-1): the weights replicated, the optimizer state split
# over data; the gradient is all-reduced whole, each device updates its rows, and the new weights are gathered
def zero1_adam(mesh):
    """--mesh data=8: the gradients' all-reduce, then a gather of each updated weight."""
    d, h, batch = 256, 1024, 64
    optimizer = optax.adam(1e-3)
    shapes = {"w1": jax.ShapeDtypeStruct((d, h), jnp.float32), "w2": jax.ShapeDtypeStruct((h, d), jnp.float32)}
    replicated = NamedSharding(mesh, P())
    rows = jax.tree.map(lambda a: NamedSharding(mesh, P("data", None) if a.ndim == 2 else P()), optimizer.init(shapes))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), shapes)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(optimizer.init, shapes), rows
    )

    def loss(p, x):
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - x) ** 2)

    def step(p, s, x):
        g = jax.grad(loss)(p, x)
        g = jax.lax.with_sharding_constraint(g, jax.tree.map(lambda _: NamedSharding(mesh, P("data", None)), g))
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s

    x = _abstract(mesh, (batch, d), P("data", None))
    return jax.jit(step, out_shardings=(jax.tree.map(lambda _: replicated, shapes), rows)), (params, state, x)


# https://flax.readthedocs.io/en/v0.6.10/guides/flax_on_pjit.html, "Scale up Flax Modules on multiple devices":
# DotReluDot under nn.scan, its weights split over the model axis, an Adam TrainState; each layer's gradient is
# all-reduced over data inside the scanned backward and stacked in the loop's carry
class _DotReluDot(nn.Module):
    depth: int
    mesh: object

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.xavier_normal()
        y = nn.Dense(self.depth, kernel_init=nn.with_partitioning(init, (None, "tensor")), use_bias=False)(x)
        y = jax.lax.with_sharding_constraint(jax.nn.relu(y), NamedSharding(self.mesh, P("data", "tensor")))
        w2 = self.param("W2", nn.with_partitioning(init, ("tensor", None)), (self.depth, x.shape[-1]))
        return jax.lax.with_sharding_constraint(jnp.dot(y, w2), NamedSharding(self.mesh, P("data", None))), None


class _ScannedMLP(nn.Module):
    layers: int
    depth: int
    mesh: object

    @nn.compact
    def __call__(self, x):
        scanned = nn.scan(
            _DotReluDot,
            length=self.layers,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            metadata_params={nn.PARTITION_NAME: None},
        )
        return scanned(self.depth, self.mesh)(x)[0]


def flax_scanned_mlp(mesh):
    """--mesh data=2,tensor=4: per layer, the activations' all-reduce over tensor and the gradient's over data."""
    model, optimizer, x_shape = _ScannedMLP(4, 512, mesh), optax.adam(1e-3), (8, 512)

    def init(x):
        params = model.init(jax.random.key(0), x)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optimizer)

    boxed = jax.eval_shape(init, jnp.ones(x_shape))
    shardings = nn.get_sharding(boxed, mesh)
    unboxed = jax.tree.map(
        lambda b: b.value if isinstance(b, nn.Partitioned) else b,
        boxed,
        is_leaf=lambda b: isinstance(b, nn.Partitioned),
    )
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), unboxed, shardings)

    def train_step(state, x):
        grads = jax.grad(lambda params: model.apply({"params": params}, x).sum())(state.params)
        return state.apply_gradients(grads=grads)

    x = _abstract(mesh, x_shape, P("data", None))
    return jax.jit(train_step, out_shardings=jax.tree.map(lambda a: a.sharding, state)), (state, x)


# https://github.com/haoliuhl/ringattention (ringattention/ringattention_base.py, _ring_attention_fwd): a scan over
# the ring, each device's queries against the visiting key/value block, k and v sent on (i -> i+1); one chunk per
# block, no bias, differentiated by autodiff in place of its hand-written backward; sequence over fsdp, batch over
# data; its gradients returned in q, k, v order, psum'd over nothing as the last op
def ring_attention(mesh):
    def attend(q, k, v):
        scale = jnp.sqrt(q.shape[-1])
        ring = jax.lax.psum(1, "fsdp")

        def block(carry, _):
            prev_max, numerator, denominator, k, v = carry
            w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / scale
            max_score = jax.lax.stop_gradient(jnp.maximum(prev_max, jnp.max(w, axis=-1)))
            ew = jnp.exp(w - max_score[..., None])
            corr = jnp.exp(prev_max - max_score)
            numerator = numerator * jnp.transpose(corr, (0, 2, 1))[..., None] + jnp.einsum("bhqk,bkhd->bqhd", ew, v)
            denominator = denominator * corr + ew.sum(axis=-1)
            k, v = (jax.lax.ppermute(x, "fsdp", perm=[(i, (i + 1) % ring) for i in range(ring)]) for x in (k, v))
            return (max_score, numerator, denominator, k, v), None

        b, s, h, _ = q.shape
        start = (jnp.full((b, h, s), -jnp.inf, q.dtype), jnp.zeros_like(q), jnp.zeros((b, h, s), q.dtype), k, v)
        (_, numerator, denominator, _, _), _ = jax.lax.scan(block, start, jnp.arange(ring))
        return numerator / jnp.transpose(denominator, (0, 2, 1))[..., None]

    spec = P("data", "fsdp", None, None)
    sharded = jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)

    @jax.jit
    def step(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(sharded(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)

    qkv = _abstract(mesh, (4, 1024, 8, 64), spec)
    return step, (qkv, qkv, qkv)


# https://flax.readthedocs.io/en/latest/guides/flax_gspmd.html, "Shard a wholesome model": MultiDotReluDot (layers
# made by nnx.vmap, run by lax.scan, a with_sharding_constraint inside), nnx.Optimizer(adam), a jitted train step;
# its weights are `dot1.kernel` and `w2` (a name that says nothing of a weight); 'model' -> 'tensor'
def flax_nnx_scanned_train_step(mesh):
    from flax import nnx

    class DotReluDot(nnx.Module):
        def __init__(self, depth: int, rngs: nnx.Rngs):
            init_fn = nnx.initializers.lecun_normal()
            self.dot1 = nnx.Linear(
                depth, depth, kernel_init=nnx.with_partitioning(init_fn, (None, "tensor")), use_bias=False, rngs=rngs
            )
            self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), out_sharding=("tensor", None))

        def __call__(self, x):
            y = jax.lax.with_sharding_constraint(jax.nn.relu(self.dot1(x)), P("data", "tensor"))
            return jnp.dot(y, self.w2[...])

    class MultiDotReluDot(nnx.Module):
        def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
            @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
            def create_sublayers(r):
                return DotReluDot(depth, r)

            self.layers = create_sublayers(rngs.split(num_layers))

        def __call__(self, x):
            x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
            return x

    @jax.jit
    def train_step(model, optimizer, x, y):
        loss, grads = jax.value_and_grad(lambda model: jnp.mean((model(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return model, loss

    def build():
        model = MultiDotReluDot(1024, 2, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    x = _abstract(mesh, (8, 1024), P("data", None))
    return train_step, (model, optimizer, x, x)


# https://flax.readthedocs.io/en/latest/mnist_tutorial.html: the train step as NNX writes it, `@nnx.jit` with
# `nnx.value_and_grad` and `nnx.Optimizer`; its Linear kernels split as the flax_gspmd guide splits them. nnx.jit
# hands JAX each object's leaves by position (`model.states[0][3]`)
def flax_nnx_jit_train_step(mesh):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.l1 = nnx.Linear(512, 2048, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")), rngs=rngs)
            self.l2 = nnx.Linear(2048, 512, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")), rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda model: jnp.mean((model(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def build():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    with jax.set_mesh(mesh):
        model, optimizer = nnx.eval_shape(build)
    x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))
    return train_step, (model, optimizer, x, x)


# https://docs.jax.dev/en/latest/notebooks/shard_map.html (all_gather, psum_scatter) as Megatron's sequence
# parallelism uses them (Korthikanti et al. 2022, "Reducing Activation Recomputation"): the sequence gathered over
# tensor before the column-parallel matmul, the row-parallel one's partial sums scattered back over it; the weights'
# gradients are returned, psum'd over data by autodiff as the step's last op
def sequence_parallel_mlp(mesh):
    def mlp(x, w1, w2):
        x = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
        y = jax.nn.gelu(x @ w1) @ w2
        return jax.lax.psum_scatter(y, "tensor", scatter_dimension=1, tiled=True)

    specs = (P("data", "tensor", None), P(None, "tensor"), P("tensor", None))
    sharded = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=specs[0])
    step = jax.jit(jax.grad(lambda x, w1, w2: jnp.sum(sharded(x, w1, w2) ** 2), argnums=(1, 2)))
    shapes = ((8, 512, 256), (256, 1024), (1024, 256))
    return step, tuple(
        jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
        for shape, spec in zip(shapes, specs)
    )


# https://docs.jax.dev/en/latest/notebooks/explicit-sharding.html: a matmul's out_sharding, then `reshard` to
# another layout; the move is what reshard asks for
def explicit_reshard(mesh):
    def f(x, w):
        y = jnp.dot(x, w, out_sharding=P("data", None))
        return jnp.sum(jax.sharding.reshard(y, P(None, "tensor")) * 2, axis=0)

    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data", "tensor")))
    w = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=NamedSharding(mesh, P("tensor", None)))
    return jax.jit(f), (x, w)


# https://docs.jax.dev/en/latest/_autosummary/jax.lax.ragged_all_to_all.html: MoE dispatch of ragged groups of
# tokens over the expert axis (XLA:CPU has no ragged-all-to-all; TPU's and GPU's compilers do)
def ragged_dispatch(mesh):
    def dispatch(x, send_sizes, recv_sizes):
        in_offsets, out_offsets = jnp.cumsum(send_sizes) - send_sizes, jnp.cumsum(recv_sizes) - recv_sizes
        out = jnp.zeros_like(x)
        return jax.lax.ragged_all_to_all(x, out, in_offsets, send_sizes, out_offsets, recv_sizes, axis_name="expert")

    n = mesh.shape["expert"]
    sharded = jax.shard_map(dispatch, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert"))
    x = jax.ShapeDtypeStruct((n * 128, 256), jnp.float32, sharding=NamedSharding(mesh, P("expert")))
    sizes = jax.ShapeDtypeStruct((n * n,), jnp.int32, sharding=NamedSharding(mesh, P("expert")))
    return jax.jit(sharded), (x, sizes, sizes)


# https://github.com/AI-Hypercomputer/maxtext (src/maxtext/layers/pipeline.py): a pipeline as a vmap over the
# stage-sharded axis of the stages' weights and states (spmd_axis_name="stage"), each iteration's outputs rotated to
# the next stage; here with jnp.roll, where MaxText rotates with a ppermute inside shard_map
def rolled_pipeline(mesh):
    stages = mesh.shape["stage"]
    layout = NamedSharding(mesh, P("stage", "data"))

    def loss(weights, state):
        for _ in range(stages):
            state = jax.vmap(lambda w, x: jnp.tanh(x @ w), spmd_axis_name="stage")(weights, state)
            state = jax.lax.with_sharding_constraint(jnp.roll(state, 1, axis=0), layout)
        return jnp.sum(state**2)

    weights = jax.ShapeDtypeStruct((stages, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P("stage")))
    state = jax.ShapeDtypeStruct((stages, 32, 256), jnp.float32, sharding=layout)
    return jax.jit(jax.grad(loss)), (weights, state)


# https://github.com/google/flax (examples/imagenet/train.py, under pmap: `grads = lax.pmean(grads,
# axis_name='batch')`) ported to shard_map as written: there autodiff already sums the gradient of the weights the
# in_specs replicate, so the pmean returns the devices' sum of gradients where their mean was meant
def pmap_era_pmean_of_grads(mesh):
    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    def step(w, x):
        grads = jax.grad(loss)(w, x)
        grads = jax.lax.pmean(grads, ("data", "fsdp"))
        return w - 0.1 * grads

    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(("data", "fsdp"))), out_specs=P())
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    return jax.jit(sharded), (w, x)


# https://github.com/AI-Hypercomputer/maxtext (gradient_accumulation.py): the micro-batches scanned, each one's
# gradient added to a carried sum, the weights split over fsdp (FSDP) and the batch over data and fsdp
def scanned_microbatch_gradients(mesh):
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w["w_in"]) @ w["w_out"])

    def step(w, xs):
        def micro(total, x):
            return jax.tree.map(jnp.add, total, jax.grad(loss)(w, x)), None

        grads, _ = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, w), xs)
        return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads)

    w = {
        "w_in": jax.ShapeDtypeStruct((512, 2048), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None))),
        "w_out": jax.ShapeDtypeStruct((2048, 512), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))),
    }
    xs = jax.ShapeDtypeStruct((4, 32, 512), jnp.float32, sharding=NamedSharding(mesh, P(None, ("data", "fsdp"))))
    return jax.jit(step), (w, xs)
