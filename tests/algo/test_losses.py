import pytest
import torch

from opct.algo import losses


def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    tok = torch.randint(0, 11, (2, 3))
    want = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
    assert torch.allclose(losses.token_logprobs(logits, tok), want, atol=1e-6)


def test_sampled_loss_is_zero_with_zero_grad_when_teacher_equals_student():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    loss, kl = losses.sampled_token_loss(logp, logp.detach().clone(), torch.ones(1, 3))
    loss.backward()
    assert loss.item() == 0.0 and kl.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_sampled_loss_value_and_gradient_pinned():
    logp_s = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    logp_t = torch.tensor([[-1.5, -1.0, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, kl = losses.sampled_token_loss(logp_s, logp_t, mask)
    loss.backward()
    # k = [0.5, -1.0, 0, (masked)] -> value = sum k = -0.5; grad = k (advantage -k, loss -A*logp)
    assert loss.item() == pytest.approx(-0.5) and kl.item() == pytest.approx(-0.5)
    assert torch.allclose(logp_s.grad, torch.tensor([[0.5, -1.0, 0.0, 0.0]]))


def test_discounted_future_sum():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(losses.discounted_future_sum(x, 0.0), x)
    assert torch.allclose(losses.discounted_future_sum(x, 0.5), torch.tensor([[1 + 1 + 0.75, 2 + 1.5, 3.0]]))


def test_sampled_estimator_mean_matches_exact_kl_and_its_gradient():
    # Toy categorical: E_{y~p_s}[log p_s(y) - log p_t(y)] = KL(p_s || p_t), and the mean REINFORCE gradient of the
    # sampled-token loss equals the gradient of the exact KL.
    g = torch.Generator().manual_seed(0)
    logits_s = torch.tensor([1.0, 0.0, -1.0, 2.0], requires_grad=True)
    logits_t = torch.tensor([0.0, 1.0, 0.0, 0.5])
    exact = losses.reverse_kl(logits_s[None], logits_t[None])[0]
    exact_grad, = torch.autograd.grad(exact, logits_s)
    n = 200_000
    y = torch.multinomial(torch.softmax(logits_s.detach(), -1), n, replacement=True, generator=g)
    logp_s = torch.log_softmax(logits_s, -1)[y][None]
    logp_t = torch.log_softmax(logits_t, -1)[y][None]
    loss, kl = losses.sampled_token_loss(logp_s, logp_t, torch.ones(1, n))
    (loss / n).backward()
    assert (kl / n).item() == pytest.approx(exact.item(), abs=0.01)
    assert torch.allclose(logits_s.grad, exact_grad, atol=0.01)


def test_exact_kls_pinned():
    s = torch.tensor([[2.0, 0.0, 0.0]])
    t = torch.tensor([[0.0, 0.0, 0.0]])
    p = torch.softmax(s, -1)
    want_rev = (p * (p.log() - torch.log(torch.tensor(1 / 3)))).sum()
    assert losses.reverse_kl(s, t).item() == pytest.approx(want_rev.item(), abs=1e-6)
    assert losses.reverse_kl(s, t).item() == pytest.approx(0.4330, abs=1e-4)
    want_fwd = (torch.full((3,), 1 / 3) * (torch.log(torch.tensor(1 / 3)) - p.log())).sum()
    assert losses.forward_kl(s, t).item() == pytest.approx(want_fwd.item(), abs=1e-6)
    assert losses.reverse_kl(s, s).item() == 0.0 and losses.forward_kl(s, s).item() == 0.0


def test_topk_with_full_k_equals_full_and_is_partial_below():
    torch.manual_seed(1)
    s, t = torch.randn(5, 17), torch.randn(5, 17)
    assert torch.allclose(losses.topk_reverse_kl(s, t, k=17), losses.reverse_kl(s, t), atol=1e-6)
    p = torch.softmax(s, -1)
    top2 = p.topk(2, -1).indices
    want = (p.gather(-1, top2) * (p.log() - torch.log_softmax(t, -1)).gather(-1, top2)).sum(-1)
    assert torch.allclose(losses.topk_reverse_kl(s, t, k=2), want, atol=1e-6)


@pytest.mark.parametrize("name", ["full", "topk", "forward"])
def test_chunked_matches_unchunked_value_and_gradient(name):
    torch.manual_seed(2)
    H, V, N = 8, 13, 10
    w = torch.randn(V, H, requires_grad=True)
    h_s = torch.randn(N, H, requires_grad=True)
    h_t = torch.randn(N, H)
    kw = {"k": 4} if name == "topk" else {}
    fn = losses.EXACT[name]
    full = fn(h_s @ w.T, h_t @ w.T, **kw)
    g_full = torch.autograd.grad(full.sum(), [h_s, w])
    chunked = losses.exact_kl(name, lambda h: h @ w.T, lambda h: h @ w.T, h_s, h_t, chunk=3, **kw)
    g_chunk = torch.autograd.grad(chunked.sum(), [h_s, w])
    assert torch.allclose(full, chunked, atol=1e-6)
    for a, b in zip(g_full, g_chunk):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("chunk", [7, 10, 101, 4096])  # uneven, even, exactly V, larger than V
def test_hidden_token_logprobs_matches_full_logits_and_their_gradients(chunk):
    torch.manual_seed(0)
    h = torch.randn(13, 16, dtype=torch.double, requires_grad=True)
    w = torch.randn(101, 16, dtype=torch.double, requires_grad=True)
    tok = torch.randint(0, 101, (13,))
    from opct.backends.cpu.logprobs import hidden_token_logprobs

    got = hidden_token_logprobs(h, w, tok, chunk=chunk)
    want = losses.token_logprobs(h @ w.T, tok)
    assert torch.allclose(got, want, atol=1e-12)
    g = torch.randn(13, dtype=torch.double)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(torch.autograd.grad(got, (h, w), g),
                                                                   torch.autograd.grad(want, (h, w), g, retain_graph=True)))
    # frozen head (the LoRA case): the gradient is formed in the forward; same values, same gradient in h
    got_frozen = hidden_token_logprobs(h, w.detach(), tok, chunk=chunk)
    assert torch.equal(got_frozen.detach(), got.detach())  # the forward is the same computation in every mode
    assert torch.allclose(torch.autograd.grad(got_frozen, h, g)[0], torch.autograd.grad(want, h, g)[0], atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: hidden_token_logprobs(x, w.detach(), tok, chunk=chunk), (h,))


def test_truncated_is_weights_are_one_for_equal_logprobs_and_capped_otherwise():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w, ratio = losses.truncated_is_weights(logp, logp.clone(), mask, cap=2.0)
    assert torch.equal(w, torch.ones_like(w)) and torch.equal(ratio, torch.ones_like(ratio))
    sampler = logp - torch.tensor([[1.0, -1.0, 0.1], [0.2, 5.0, 5.0]])  # the trainer's minus a shift
    w, ratio = losses.truncated_is_weights(logp, sampler, mask, cap=2.0)
    e = torch.exp(torch.tensor([1.0, -1.0, 0.1, 0.2]))
    assert torch.allclose(ratio[mask.bool()], e)
    assert torch.allclose(w[mask.bool()], e.clamp(max=2.0)) and w.max() <= 2.0
    assert torch.equal(w[~mask.bool()], torch.ones(2))  # padding: weight 1, never a huge ratio


def test_the_weighted_update_from_another_sampler_equals_the_on_policy_update_in_expectation():
    """A one-token toy: the student p_s (trainable logits), the teacher p_t, a sampler q != p_s. The expectation over
    y ~ q of the importance-weighted loss's gradient (weights p_s / q, the cap above every ratio) equals the
    expectation over y ~ p_s of the plain loss's gradient, exactly (enumerating y); truncating at a low cap bounds
    every weight and biases the update."""
    logits_s = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5], requires_grad=True)
    logp_t = torch.log_softmax(torch.tensor([0.0, 1.0, 0.0, 0.5, -1.0]), -1)
    logp_q = torch.log_softmax(torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0]), -1)  # the perturbed sampler
    V = logits_s.numel()

    def expected_grad(weighting: str, cap: float = 100.0):
        total = torch.zeros(V)
        for y in range(V):
            logp_s = torch.log_softmax(logits_s, -1)  # a fresh graph for each token's gradient
            lp_s, lp_t = logp_s[y].reshape(1, 1), logp_t[y].reshape(1, 1)
            if weighting == "on-policy":
                loss, _ = losses.sampled_token_loss(lp_s, lp_t, torch.ones(1, 1))
                prob = logp_s[y].exp().detach()
            else:
                w, _ = losses.truncated_is_weights(lp_s, logp_q[y].reshape(1, 1), torch.ones(1, 1), cap)
                loss, _ = losses.sampled_token_loss(lp_s, lp_t, torch.ones(1, 1), weight_BT=w)
                prob = logp_q[y].exp()
            g, = torch.autograd.grad(loss, logits_s)
            total += prob * g
        return total

    on_policy = expected_grad("on-policy")
    ratios = (torch.log_softmax(logits_s, -1) - logp_q).exp().detach()
    assert ratios.max() > 1.5 and ratios.min() < 0.5  # the sampler is really off the student
    assert torch.allclose(expected_grad("weighted"), on_policy, atol=1e-6)
    truncated = expected_grad("weighted", cap=1.2)
    assert not torch.allclose(truncated, on_policy, atol=1e-3)  # a cap below the largest ratio biases the update
    # ... and the plain loss on the sampler's tokens (no correction) is further off than the truncated one
    plain = sum(logp_q[y].exp() * torch.autograd.grad(losses.sampled_token_loss(
        torch.log_softmax(logits_s, -1)[y].reshape(1, 1), logp_t[y].reshape(1, 1), torch.ones(1, 1))[0],
        logits_s)[0] for y in range(V))
    assert (plain - on_policy).norm() > (truncated - on_policy).norm()
