/* Unit tests for src/engram_hash.c (MODEL.md §3.4).
 *
 * The engram table rows in a checkpoint were laid out by the reference's Python: primes from a
 * shared "seen" set, per-table offsets, and multipliers from numpy's default_rng. Any difference,
 * even one bit in one multiplier, silently reads the wrong rows, so every expected value here is a
 * literal taken from an independent source: the spec's tables for the real model, numpy itself
 * (generated once and pasted in) for the RNG, sympy for the primes, and the golden fixtures'
 * engram.safetensors / promptK.safetensors for the small models and their hash ids. The
 * model_config is built by hand so these tests do not depend on the config parser. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "engram_hash.h"
#include "log.h"

/* ---------------------------------------------------------------------------------------------
 * Expected values
 * ------------------------------------------------------------------------------------------- */

/* MODEL.md §3.4: real config, layers [1, 14], [layer][n-gram 2..4][head 0..7]. */
static const int64_t real_primes[2][3][8] = {
    {{16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183},
     {16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321},
     {16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463}},
    {{16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627},
     {16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769},
     {16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889}},
};
static const int64_t real_sums[2] = {384006168LL, 384016682LL};
static const int64_t real_mult[2][4] = {
    {76632096046245LL, 4839876093313LL, 35959672319349LL, 73987337458391LL},
    {67716810739261LL, 51510806800915LL, 30921347202721LL, 82619226485591LL},
};

/* numpy 2.4.6: np.random.default_rng(seed).integers(0, high, size=6, dtype=np.int64) */
static const uint64_t rng_seeds[7] = {
    0ULL, 1ULL, 42ULL, 10007ULL,
    140098ULL, 4294967299ULL, 9223372036854775819ULL,
};
static const int64_t rng_highs[10] = {
    2LL, 1000LL, 2147483647LL,
    3221225472LL, 4294967295LL, 4294967296LL,
    4294967297LL, 6917529027641081856LL, 46539438283891LL,
    9223372036854775807LL,
};
/* [seed][high][6] */
static const int64_t rng_expect[420] = {
    1LL, 1LL, 1LL,
    0LL, 0LL, 0LL,
    850LL, 636LL, 511LL,
    269LL, 307LL, 40LL,
    1826701614LL, 1367864806LL, 1097657231LL,
    579362555LL, 661058651LL, 87989972LL,
    2740052423LL, 2051797211LL, 1646485848LL,
    131984958LL, 242365461LL, 53239240LL,
    3653403230LL, 2735729614LL, 2195314464LL,
    1158725111LL, 1322117303LL, 175979944LL,
    3653403231LL, 2735729615LL, 2195314465LL,
    1158725112LL, 1322117304LL, 175979945LL,
    2735729616LL, 1158725112LL, 175979945LL,
    70985654LL, 3492969080LL, 3920255354LL,
    4406200961541402851LL, 1866257423733469356LL, 114330398526872074LL,
    6314013200959933085LL, 4196420588075033327LL, 5046313636171151833LL,
    29643839136299LL, 12555722115027LL, 1906884788502LL,
    769186873658LL, 37849140105386LL, 42479131856993LL,
    5874934615388537134LL, 2488343231644625808LL, 377914054924498011LL,
    152440531369162766LL, 7501093982645987484LL, 8418684267946577446LL,
    0LL, 1LL, 1LL,
    1LL, 0LL, 0LL,
    473LL, 511LL, 755LL,
    950LL, 34LL, 144LL,
    1016164991LL, 1099128568LL, 1621709874LL,
    2041105244LL, 74845286LL, 309580410LL,
    1524247487LL, 1648692854LL, 2432564812LL,
    3061657868LL, 112267929LL, 464370616LL,
    2032329982LL, 2198257138LL, 3243419749LL,
    4082210490LL, 149690572LL, 619160821LL,
    2032329983LL, 2198257139LL, 3243419750LL,
    4082210491LL, 149690573LL, 619160822LL,
    2198257139LL, 4082210492LL, 619160822LL,
    4074418351LL, 1339305888LL, 1818173254LL,
    3540540945838446047LL, 6574860209053695782LL, 997228305601562956LL,
    6562310087627549166LL, 2157103121014000383LL, 5725656719006722285LL,
    23819890915098LL, 44234046536239LL, 6709107399195LL,
    44149612398091LL, 14512460615818LL, 19701375145897LL,
    4720721261117928062LL, 8766480278738261042LL, 1329637740802083942LL,
    8749746783503398888LL, 2876137494685333844LL, 3904497331914684451LL,
    0LL, 1LL, 1LL,
    0LL, 0LL, 1LL,
    89LL, 773LL, 654LL,
    438LL, 433LL, 858LL,
    191664963LL, 1662057957LL, 1405681631LL,
    942484272LL, 929893137LL, 1843824992LL,
    2493086937LL, 2108522448LL, 1413726408LL,
    2765737489LL, 276850281LL, 2246379658LL,
    383329927LL, 3324115916LL, 2811363264LL,
    1884968544LL, 1859786275LL, 3687649985LL,
    383329928LL, 3324115917LL, 2811363265LL,
    1884968545LL, 1859786276LL, 3687649986LL,
    3324115917LL, 1884968546LL, 3687649987LL,
    2995172878LL, 404488629LL, 4190266094LL,
    3035954346590650344LL, 5939376034059241549LL, 4824063583966999348LL,
    6748895937462714196LL, 5265205982608349610LL, 3115557799033939721LL,
    36019479756214LL, 20425156060971LL, 39958664904392LL,
    32455116349566LL, 4382960869757LL, 45404916222383LL,
    7138484576005690179LL, 4047939128787533792LL, 7919168045412322065LL,
    6432084778622665797LL, 868632717012091125LL, 8998527916616952261LL,
    0LL, 1LL, 1LL,
    0LL, 1LL, 0LL,
    149LL, 823LL, 619LL,
    51LL, 547LL, 386LL,
    322113305LL, 1768029215LL, 1331345945LL,
    111663946LL, 1176365972LL, 829649122LL,
    483169958LL, 1997018919LL, 167495920LL,
    1764548960LL, 1244473683LL, 964627058LL,
    644226610LL, 3536058431LL, 2662691892LL,
    223327893LL, 2352731946LL, 1659298244LL,
    644226611LL, 3536058432LL, 2662691893LL,
    223327894LL, 2352731947LL, 1659298245LL,
    3536058432LL, 223327894LL, 1659298245LL,
    3414020522LL, 1843754792LL, 3248645799LL,
    359694751378967443LL, 1538764283633127253LL, 155932486627929098LL,
    4429730739593083823LL, 6568070154937853261LL, 5627591143264223544LL,
    38316048023122LL, 2419938046656LL, 17979836159674LL,
    36993668729195LL, 19978571768672LL, 35201700093836LL,
    7593627661414633240LL, 479593001838623258LL, 3563315849468963733LL,
    7331553243427025312LL, 3959433267402557499LL, 6976413731397036915LL,
    1LL, 1LL, 0LL,
    1LL, 0LL, 0LL,
    808LL, 727LL, 63LL,
    553LL, 466LL, 332LL,
    1736695943LL, 1562338835LL, 137397693LL,
    1188439518LL, 1002436873LL, 713406627LL,
    2605043916LL, 2343508254LL, 1782659278LL,
    1503655310LL, 2373071734LL, 2859243327LL,
    3473391888LL, 3124677672LL, 274795387LL,
    2376879037LL, 2004873746LL, 1426813255LL,
    3473391889LL, 3124677673LL, 274795388LL,
    2376879038LL, 2004873747LL, 1426813256LL,
    3124677674LL, 2376879038LL, 1426813256LL,
    3812324438LL, 2324134983LL, 1731166316LL,
    5032645657331165286LL, 3828231650637276238LL, 6140178293182765499LL,
    3743281403720626725LL, 2788238517479838233LL, 5521380993308339395LL,
    33858405369630LL, 25755403400457LL, 15460673601360LL,
    41309613242795LL, 25183878979268LL, 18758584732570LL,
    6710194209774887047LL, 5104308867516368317LL, 3064058137012074761LL,
    8186904390910353998LL, 4991041871627502299LL, 3717651356639784311LL,
    1LL, 0LL, 1LL,
    0LL, 1LL, 0LL,
    978LL, 253LL, 579LL,
    407LL, 772LL, 341LL,
    2100730120LL, 543856842LL, 1243875292LL,
    874449309LL, 1659216627LL, 733081299LL,
    3151095182LL, 815785264LL, 1865812940LL,
    1311673964LL, 485783147LL, 1376897926LL,
    4201460242LL, 1087713685LL, 2487750586LL,
    1748898618LL, 3318433255LL, 1466162599LL,
    4201460243LL, 1087713686LL, 2487750587LL,
    1748898619LL, 3318433256LL, 1466162600LL,
    1087713687LL, 1748898619LL, 1466162601LL,
    1835863902LL, 2313962395LL, 3893567346LL,
    2956865782366747445LL, 3726897303762192415LL, 6271029155236570476LL,
    2273539989754166784LL, 5172962660951480329LL, 4353672183002574451LL,
    11786255986817LL, 18950728553042LL, 15887055516430LL,
    19893067602946LL, 25073650774109LL, 42189945742249LL,
    2335847356491536649LL, 3755731187556157405LL, 3148560210468381427LL,
    3942487709822329927LL, 4969196405016256553LL, 8361372206982093967LL,
    1LL, 0LL, 0LL,
    1LL, 0LL, 0LL,
    542LL, 169LL, 432LL,
    807LL, 134LL, 263LL,
    1165964295LL, 364892671LL, 929535901LL,
    1734468758LL, 289574757LL, 566297733LL,
    1394303852LL, 2601703138LL, 849446600LL,
    854096632LL, 1878157852LL, 711331140LL,
    2331928591LL, 729785343LL, 1859071802LL,
    3468937517LL, 579149515LL, 1132595466LL,
    2331928592LL, 729785344LL, 1859071803LL,
    3468937518LL, 579149516LL, 1132595467LL,
    729785344LL, 3468937519LL, 1132595467LL,
    2504210470LL, 948441522LL, 196182923LL,
    1824172684103248780LL, 4033313277033594236LL, 315974714349627353LL,
    5706772213525232451LL, 6164390888474423838LL, 4384507920161968231LL,
    7907813415593LL, 37588738731522LL, 12272586311059LL,
    27135142272053LL, 10277129632762LL, 2125800362959LL,
    1567202093956019207LL, 7449486596768241564LL, 2432230245470998373LL,
    5377751036044792314LL, 2036762659139373751LL, 421299619132836470LL,
};
/* default_rng(7).integers(0, 3221225473, size=40) */
static const int64_t rng_long32[40] = {
    2013573439LL, 2203897840LL, 2890127949LL,
    2685377906LL, 725443136LL, 178879731LL,
    918265191LL, 2939765076LL, 16960732LL,
    423400198LL, 2567540347LL, 383593176LL,
    1507323989LL, 2630018358LL, 976135771LL,
    896871673LL, 2317578036LL, 820992407LL,
    3190494254LL, 1540225366LL, 1625263703LL,
    1876502122LL, 1782939769LL, 1641044624LL,
    3206730870LL, 2255741897LL, 1098521362LL,
    693557862LL, 2722216921LL, 516079083LL,
    2762037394LL, 1973128175LL, 369517844LL,
    141547115LL, 1432667912LL, 114934222LL,
    455988771LL, 1658572983LL, 3125441279LL,
    1501754723LL,
};
/* default_rng(7).integers(0, 2147483647, size=40) */
static const int64_t rng_long31[40] = {
    2029167940LL, 1342382291LL, 1469265225LL,
    1926751965LL, 1241873584LL, 1665772334LL,
    1790251936LL, 483628757LL, 119253154LL,
    644602188LL, 612176793LL, 1875941738LL,
    1959843383LL, 11307154LL, 1073283950LL,
    1763574598LL, 282266798LL, 1711693563LL,
    255728784LL, 1004882659LL, 1753345571LL,
    650757180LL, 733587778LL, 597914448LL,
    1545052023LL, 547328271LL, 2126996168LL,
    955794088LL, 1026816910LL, 1083509134LL,
    1251001413LL, 1188626511LL, 1094029748LL,
    2137820579LL, 1734444720LL, 1702228508LL,
    1503827930LL, 1336119720LL, 732347574LL,
    2123775744LL,
};
/* default_rng(7).integers(0, 6917529027641081857, size=40) */
static const int64_t rng_long64[40] = {
    4324116035284630516LL, 6206502512207226872LL, 5365828278596935045LL,
    1557877273993399992LL, 6042831315724521140LL, 5680871422486561427LL,
    3236953619344299372LL, 2096235608839123611LL, 1763067770860320666LL,
    3490227227187412139LL, 3828833999697777461LL, 5483261835266827525LL,
    1489404169948370103LL, 1108271394789055980LL, 4237260493138472009LL,
    3561758360235076370LL, 3224993713048861055LL, 6344534694278488084LL,
    3437136412398311954LL, 1330947415998765662LL, 1387702836320022395LL,
    25831727791473911LL, 632923503925203051LL, 6027515431199689255LL,
    4137955648778300178LL, 2681454236220260937LL, 1039010985788676976LL,
    5647042529537935330LL, 2624829906126564833LL, 4081284662468002823LL,
    4185494199223767275LL, 4413359867139046917LL, 1043080499617690565LL,
    668953376864580123LL, 6694978636895517169LL, 1487296669469328351LL,
    4646955012121595500LL, 4580889674987998225LL, 910456226350617567LL,
    3941048742919492135LL,
};
/* sympy.nextprime */
static const int64_t np_start[13] = {
    0LL, 1LL, 2LL,
    3LL, 4LL, 15999999LL,
    16000057LL, 100LL, 3215031750LL,
    3825123056546413050LL, 4611686018427387904LL, 9223372036854775782LL,
    4294967290LL,
};
static const int64_t np_expect[13] = {
    2LL, 2LL, 3LL,
    5LL, 5LL, 16000057LL,
    16000079LL, 101LL, 3215031767LL,
    3825123056546413057LL, 4611686018427388039LL, 9223372036854775783LL,
    4294967291LL,
};
/* golden/small6/engram.safetensors */
static const int64_t small6_primes[12] = {
    101LL, 103LL, 107LL, 109LL, 113LL, 127LL,
    131LL, 137LL, 139LL, 149LL, 151LL, 157LL,
};
static const int64_t small6_offsets[12] = {
    0LL, 101LL, 204LL, 311LL, 420LL, 533LL,
    0LL, 131LL, 268LL, 407LL, 556LL, 707LL,
};
static const int64_t small6_mult[8] = {
    22948963341361471LL, 9720090748611819LL,
    1476226777048821LL, 595470825660793LL,
    29662608052400909LL, 1873410163432121LL,
    13919202536988139LL, 28638879857136817LL,
};
/* golden/small6/prompt0.safetensors: prompt_ids (S=5), then greedy_tokens[0..16) fed at S+k */
static const int32_t small6_tokens[21] = {
    179, 199, 23, 80, 139, 46, 25, 262, 77, 363, 459, 389, 191, 481, 361, 70,
    227, 15, 129, 465, 208,
};
/* engram.0.hash_ids (5 rows) then decode_hash_ids[0..16) */
static const int32_t small6_ids_L0[126] = {
    16, 140, 252, 318, 491, 623,
    39, 163, 234, 350, 509, 545,
    40, 158, 293, 337, 484, 601,
    42, 180, 309, 336, 510, 559,
    1, 180, 246, 356, 520, 585,
    19, 174, 295, 311, 444, 548,
    92, 146, 302, 414, 517, 579,
    42, 172, 264, 375, 444, 546,
    94, 118, 278, 339, 478, 617,
    98, 143, 299, 417, 515, 542,
    16, 180, 278, 321, 532, 533,
    51, 143, 276, 383, 470, 649,
    58, 157, 263, 329, 496, 583,
    49, 199, 262, 391, 445, 598,
    79, 184, 218, 357, 463, 560,
    1, 108, 267, 340, 508, 585,
    60, 122, 231, 330, 443, 571,
    43, 169, 294, 342, 530, 559,
    72, 121, 291, 402, 451, 592,
    52, 149, 219, 348, 474, 572,
    92, 160, 307, 410, 496, 628,
};
/* engram.1.hash_ids (5 rows) then decode_hash_ids[0..16) */
static const int32_t small6_ids_L1[126] = {
    122, 267, 304, 444, 704, 803,
    52, 267, 305, 467, 670, 790,
    10, 198, 285, 531, 632, 772,
    26, 254, 403, 497, 653, 851,
    52, 209, 281, 484, 655, 757,
    5, 151, 380, 541, 632, 782,
    60, 251, 392, 505, 670, 767,
    5, 165, 318, 498, 665, 753,
    119, 131, 317, 428, 596, 783,
    98, 173, 330, 511, 641, 863,
    68, 171, 399, 453, 632, 731,
    3, 136, 328, 533, 671, 828,
    20, 197, 273, 476, 605, 832,
    20, 263, 297, 489, 618, 737,
    3, 149, 279, 523, 631, 727,
    35, 174, 392, 466, 586, 744,
    31, 253, 341, 407, 575, 763,
    105, 266, 380, 508, 573, 863,
    95, 245, 319, 543, 608, 813,
    41, 146, 301, 455, 644, 773,
    80, 240, 303, 480, 587, 772,
};
/* golden/tp8pp2/engram.safetensors */
static const int64_t tp8pp2_primes[12] = {
    101LL, 103LL, 107LL, 109LL, 113LL, 127LL,
    131LL, 137LL, 139LL, 149LL, 151LL, 157LL,
};
static const int64_t tp8pp2_offsets[12] = {
    0LL, 101LL, 204LL, 311LL, 420LL, 533LL,
    0LL, 131LL, 268LL, 407LL, 556LL, 707LL,
};
static const int64_t tp8pp2_mult[8] = {
    29662608052400909LL, 1873410163432121LL,
    13919202536988139LL, 28638879857136817LL,
    10655090275895937LL, 31608505986136395LL,
    4210609209496719LL, 27210409204648803LL,
};
/* golden/tp8pp2/prompt0.safetensors: prompt_ids (S=3), then greedy_tokens[0..16) fed at S+k */
static const int32_t tp8pp2_tokens[19] = {
    486, 312, 14, 160, 186, 112, 362, 374, 46, 271, 501, 316, 228, 448, 49, 123,
    56, 118, 321,
};
/* engram.1.hash_ids (3 rows) then decode_hash_ids[0..16) */
static const int32_t tp8pp2_ids_L1[114] = {
    27, 174, 221, 417, 426, 552,
    10, 139, 248, 412, 423, 567,
    18, 161, 252, 408, 478, 535,
    76, 155, 270, 408, 425, 591,
    63, 170, 293, 376, 440, 617,
    68, 129, 214, 358, 440, 613,
    27, 179, 298, 374, 490, 607,
    54, 161, 302, 403, 498, 603,
    69, 113, 303, 386, 504, 635,
    33, 146, 223, 331, 528, 594,
    58, 103, 232, 402, 498, 548,
    94, 122, 231, 414, 465, 634,
    7, 198, 210, 316, 446, 614,
    88, 169, 249, 337, 480, 566,
    27, 135, 310, 318, 464, 655,
    56, 177, 279, 397, 509, 562,
    85, 167, 217, 314, 483, 621,
    47, 174, 308, 349, 437, 608,
    56, 115, 303, 397, 502, 535,
};
/* engram.3.hash_ids (3 rows) then decode_hash_ids[0..16) */
static const int32_t tp8pp2_ids_L3[114] = {
    100, 229, 294, 502, 702, 785,
    23, 171, 372, 426, 645, 841,
    26, 152, 401, 482, 623, 778,
    75, 200, 334, 534, 704, 739,
    97, 255, 384, 502, 578, 758,
    95, 134, 275, 482, 610, 728,
    50, 134, 353, 466, 585, 842,
    71, 144, 384, 462, 583, 747,
    59, 151, 342, 433, 588, 708,
    95, 220, 277, 532, 605, 791,
    63, 203, 317, 469, 685, 733,
    100, 181, 287, 428, 606, 760,
    51, 202, 304, 431, 664, 820,
    127, 203, 280, 415, 612, 798,
    53, 166, 391, 521, 568, 725,
    12, 228, 342, 449, 693, 793,
    20, 240, 323, 421, 623, 787,
    5, 132, 321, 408, 643, 781,
    67, 228, 343, 442, 621, 827,
};

/* The small6 constants with history [10, 20, DEAD, 30, 40, 50, 60] and pad 1, every position;
 * computed with the reference's formula in Python. Position 4 sees 40, 30, DEAD: the 4-gram must
 * pad the token before the DEAD too (cumulative blocking), which a per-shift check would not. */
static const int64_t dead_hist[7] = {10, 20, ENGRAM_DEAD, 30, 40, 50, 60};
static const int64_t dead_ids[2][7][6] = {
    {{89, 139, 204, 407, 518, 641},
     {93, 142, 307, 386, 507, 547},
     {50, 139, 279, 314, 509, 618},
     {91, 189, 292, 350, 513, 556},
     {30, 198, 300, 409, 528, 658},
     {33, 192, 284, 396, 455, 630},
     {15, 142, 257, 311, 532, 637}},
    {{50, 148, 346, 418, 597, 810},
     {30, 171, 315, 423, 690, 854},
     {21, 231, 346, 481, 668, 739},
     {3, 241, 299, 407, 670, 771},
     {15, 221, 321, 490, 625, 711},
     {103, 134, 285, 488, 632, 739},
     {49, 255, 379, 548, 658, 839}},
};

/* ---------------------------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------------------------- */

static struct model_config *real_cfg(void) {
    struct model_config *c = calloc(1, sizeof *c);
    assert_non_null(c);
    c->n_engram = 2;
    c->engram_layer_ids[0] = 1;
    c->engram_layer_ids[1] = 14;
    c->engram_num_embeddings[0] = 384006168LL;
    c->engram_num_embeddings[1] = 384016682LL;
    c->engram_max_ngram = 4;
    c->engram_n_heads = 8;
    c->engram_head_dim = 256;
    c->engram_vocab_size = 16000000;
    c->engram_compressed_vocab = 99092;
    c->engram_pad_id = 2;
    return c;
}

/* The golden fixtures: 2 engram layers, vocab 100, 2 heads, compressed vocab 256, rows 660/864. */
static struct model_config *fixture_cfg(int l0, int l1) {
    struct model_config *c = calloc(1, sizeof *c);
    assert_non_null(c);
    c->n_engram = 2;
    c->engram_layer_ids[0] = l0;
    c->engram_layer_ids[1] = l1;
    c->engram_num_embeddings[0] = 660;
    c->engram_num_embeddings[1] = 864;
    c->engram_max_ngram = 4;
    c->engram_n_heads = 2;
    c->engram_head_dim = 32;
    c->engram_vocab_size = 100;
    c->engram_compressed_vocab = 256;
    c->engram_pad_id = 2;
    return c;
}

/* The stub tokenizer's map: token t -> t // 2 over the 512-token vocab. */
static void install_half_map(struct engram_consts *ec, const struct model_config *c) {
    int32_t map[512];
    for (int t = 0; t < 512; t++) map[t] = t / 2;
    assert_int_equal(engram_set_token_map(ec, c, map, 512), 0);
    assert_int_equal(ec->pad, 1);
    assert_int_equal(ec->vocab, 512);
}

static void check_consts(const struct engram_consts *ec, const int64_t *primes, const int64_t *offsets,
                         const int64_t *mult) {
    assert_int_equal(ec->n_layers, 2);
    assert_int_equal(ec->max_ngram, 4);
    assert_int_equal(ec->n_heads, 2);
    assert_int_equal(ec->n_cols, 6);
    for (int li = 0; li < 2; li++) {
        for (int n = 0; n < 3; n++)
            for (int h = 0; h < 2; h++) assert_int_equal(ec->primes[li][n][h], primes[li * 6 + n * 2 + h]);
        for (int c = 0; c < 6; c++) assert_int_equal(ec->offsets[li][c], offsets[li * 6 + c]);
        for (int s = 0; s < 4; s++) assert_int_equal(ec->mult[li][s], mult[li * 4 + s]);
    }
    assert_int_equal(ec->table_rows[0], 660);
    assert_int_equal(ec->table_rows[1], 864);
}

/* Replays a golden prompt: positions 0..n_tok-1 see the compressed ids of tokens[0..pos]. */
static void check_prompt_ids(const struct engram_consts *ec, const int32_t *tokens, int n_tok,
                             const int32_t *ids_l0, const int32_t *ids_l1) {
    int64_t *hist = calloc((size_t)n_tok, sizeof *hist);
    assert_non_null(hist);
    for (int p = 0; p < n_tok; p++) hist[p] = ec->token_map[tokens[p]];
    const int32_t *want[2] = {ids_l0, ids_l1};
    for (int li = 0; li < 2; li++)
        for (int p = 0; p < n_tok; p++) {
            int64_t out[6];
            engram_hash_position(ec, li, hist, p, out);
            for (int c = 0; c < 6; c++) {
                if (out[c] != want[li][p * 6 + c])
                    fail_msg("table %d position %d column %d: got %lld, want %d", li, p, c, (long long)out[c],
                             want[li][p * 6 + c]);
            }
        }
    free(hist);
}

/* ---------------------------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------------------------- */

static void test_real_primes_offsets(void **state) {
    (void)state;
    struct model_config *c = real_cfg();
    struct engram_consts ec;
    assert_int_equal(engram_consts_init(&ec, c), 0);
    assert_int_equal(ec.n_cols, 24);
    assert_null(ec.token_map);
    for (int li = 0; li < 2; li++) {
        assert_int_equal(ec.layer_ids[li], c->engram_layer_ids[li]);
        int64_t sum = 0;
        for (int n = 0; n < 3; n++)
            for (int h = 0; h < 8; h++) {
                assert_int_equal(ec.primes[li][n][h], real_primes[li][n][h]);
                assert_int_equal(ec.offsets[li][n * 8 + h], sum);
                sum += real_primes[li][n][h];
            }
        assert_int_equal(sum, real_sums[li]);
        assert_int_equal(ec.table_rows[li], real_sums[li]);
    }
    engram_consts_free(&ec);
    free(c);
}

static void test_real_multipliers(void **state) {
    (void)state;
    struct model_config *c = real_cfg();
    struct engram_consts ec;
    assert_int_equal(engram_consts_init(&ec, c), 0);
    for (int li = 0; li < 2; li++)
        for (int s = 0; s < 4; s++) assert_int_equal(ec.mult[li][s], real_mult[li][s]);
    /* The same through the public RNG entry: B = (2^63-1) // 99092 // 2 = 46539438283891. */
    int64_t v[4];
    np_default_rng_integers(10007, 46539438283891LL, 4, v);
    for (int s = 0; s < 4; s++) assert_int_equal(v[s] * 2 + 1, real_mult[0][s]);
    engram_consts_free(&ec);
    free(c);
}

static void test_numpy_rng_table(void **state) {
    (void)state;
    const int ns = (int)(sizeof rng_seeds / sizeof rng_seeds[0]);
    const int nh = (int)(sizeof rng_highs / sizeof rng_highs[0]);
    for (int i = 0; i < ns; i++)
        for (int j = 0; j < nh; j++) {
            int64_t v[6];
            np_default_rng_integers(rng_seeds[i], rng_highs[j], 6, v);
            for (int k = 0; k < 6; k++) {
                int64_t want = rng_expect[(i * nh + j) * 6 + k];
                if (v[k] != want)
                    fail_msg("seed %llu high %lld draw %d: got %lld, want %lld", (unsigned long long)rng_seeds[i],
                             (long long)rng_highs[j], k, (long long)v[k], (long long)want);
            }
        }
}

/* Long runs where roughly a quarter of the draws are rejected (and one where almost none are):
 * a wrong threshold or a rejection loop that consumes the wrong number of words shifts every
 * later value. */
static void test_numpy_rng_rejection(void **state) {
    (void)state;
    int64_t v[40];
    np_default_rng_integers(7, 3LL * (1LL << 30) + 1, 40, v);
    for (int k = 0; k < 40; k++) assert_int_equal(v[k], rng_long32[k]);
    /* 2^32 mod (2^31 - 1) = 2: nearly every low product is accepted, which a threshold of
     * 2^32 - range (missing the modulo) would reject. */
    np_default_rng_integers(7, (1LL << 31) - 1, 40, v);
    for (int k = 0; k < 40; k++) assert_int_equal(v[k], rng_long31[k]);
    np_default_rng_integers(7, 3LL * (1LL << 61) + 1, 40, v);
    for (int k = 0; k < 40; k++) assert_int_equal(v[k], rng_long64[k]);
    /* high = 1: numpy returns zeros without drawing. */
    for (int k = 0; k < 4; k++) v[k] = 99;
    np_default_rng_integers(5, 1, 4, v);
    for (int k = 0; k < 4; k++) assert_int_equal(v[k], 0);
}

static void test_next_prime(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof np_start / sizeof np_start[0]; i++)
        assert_int_equal(next_prime_above(np_start[i]), np_expect[i]);
    /* Against a sieve for every start below 20000: catches any small composite let through and
     * any prime skipped. `above` is the smallest prime > n while n walks down. */
    enum { LIM = 20100 };
    static unsigned char comp[LIM];
    comp[0] = comp[1] = 1;
    for (int i = 2; i * i < LIM; i++)
        if (!comp[i])
            for (int j = i * i; j < LIM; j += i) comp[j] = 1;
    int64_t above = 20011; /* smallest prime above 20000 */
    assert_int_equal(next_prime_above(20000), above);
    for (int n = 19999; n >= 0; n--) {
        if (!comp[n + 1]) above = n + 1;
        if (next_prime_above(n) != above)
            fail_msg("next_prime_above(%d) = %lld, want %lld", n, (long long)next_prime_above(n), (long long)above);
    }
    /* No int64 prime above 2^63 - 25. */
    assert_int_equal(next_prime_above(INT64_MAX - 24), -1);
}

static void test_small6_consts(void **state) {
    (void)state;
    struct model_config *c = fixture_cfg(0, 1);
    struct engram_consts ec;
    assert_int_equal(engram_consts_init(&ec, c), 0);
    check_consts(&ec, small6_primes, small6_offsets, small6_mult);
    engram_consts_free(&ec);
    free(c);
}

static void test_tp8pp2_consts(void **state) {
    (void)state;
    struct model_config *c = fixture_cfg(1, 3);
    struct engram_consts ec;
    assert_int_equal(engram_consts_init(&ec, c), 0);
    check_consts(&ec, tp8pp2_primes, tp8pp2_offsets, tp8pp2_mult);
    engram_consts_free(&ec);
    free(c);
}

static void test_small6_prompt0_ids(void **state) {
    (void)state;
    struct model_config *c = fixture_cfg(0, 1);
    struct engram_consts ec;
    assert_int_equal(engram_consts_init(&ec, c), 0);
    install_half_map(&ec, c);
    check_prompt_ids(&ec, small6_tokens, (int)(sizeof small6_tokens / sizeof small6_tokens[0]), small6_ids_L0,
                     small6_ids_L1);
    engram_consts_free(&ec);
    free(c);
}

static void test_tp8pp2_prompt0_ids(void **state) {
    (void)state;
    struct model_config *c = fixture_cfg(1, 3);
    struct engram_consts ec;
    assert_int_equal(engram_consts_init(&ec, c), 0);
    install_half_map(&ec, c);
    check_prompt_ids(&ec, tp8pp2_tokens, (int)(sizeof tp8pp2_tokens / sizeof tp8pp2_tokens[0]), tp8pp2_ids_L1,
                     tp8pp2_ids_L3);
    engram_consts_free(&ec);
    free(c);
}

static void test_dead_blocks_cumulatively(void **state) {
    (void)state;
    struct model_config *c = fixture_cfg(0, 1);
    struct engram_consts ec;
    assert_int_equal(engram_consts_init(&ec, c), 0);
    install_half_map(&ec, c);
    for (int li = 0; li < 2; li++)
        for (int p = 0; p < 7; p++) {
            int64_t out[6];
            engram_hash_position(&ec, li, dead_hist, p, out);
            for (int k = 0; k < 6; k++) {
                if (out[k] != dead_ids[li][p][k])
                    fail_msg("table %d position %d column %d: got %lld, want %lld", li, p, k, (long long)out[k],
                             (long long)dead_ids[li][p][k]);
            }
        }
    engram_consts_free(&ec);
    free(c);
}

static void test_sum_mismatch(void **state) {
    (void)state;
    struct model_config *c = real_cfg();
    struct engram_consts ec;
    c->engram_num_embeddings[1] += 1;
    assert_int_equal(engram_consts_init(&ec, c), -1);
    assert_non_null(strstr(ds_err_get(), "engram_num_embeddings"));
    assert_non_null(strstr(ds_err_get(), "384016682"));
    engram_consts_free(&ec);
    free(c);
}

static void test_bad_shapes(void **state) {
    (void)state;
    struct model_config *c = fixture_cfg(0, 1);
    struct engram_consts ec;
    c->engram_max_ngram = ENGRAM_MAX_NGRAM + 1;
    assert_int_equal(engram_consts_init(&ec, c), -1);
    assert_non_null(strstr(ds_err_get(), "engram_max_ngram"));
    c->engram_max_ngram = 4;
    c->engram_n_heads = 0;
    assert_int_equal(engram_consts_init(&ec, c), -1);
    assert_non_null(strstr(ds_err_get(), "engram_n_heads"));
    free(c);
}

static void test_token_map_checks(void **state) {
    (void)state;
    struct model_config *c = fixture_cfg(0, 1);
    struct engram_consts ec;
    assert_int_equal(engram_consts_init(&ec, c), 0);
    int32_t map[512];
    /* 255 classes instead of 256. */
    for (int t = 0; t < 512; t++) map[t] = t / 2 < 255 ? t / 2 : 254;
    assert_int_equal(engram_set_token_map(&ec, c, map, 512), -1);
    assert_non_null(strstr(ds_err_get(), "engram_compressed_vocab_size"));
    assert_null(ec.token_map);
    /* A negative entry. */
    for (int t = 0; t < 512; t++) map[t] = t / 2;
    map[7] = -3;
    assert_int_equal(engram_set_token_map(&ec, c, map, 512), -1);
    /* Pad id outside the map. */
    map[7] = 3;
    c->engram_pad_id = 600;
    assert_int_equal(engram_set_token_map(&ec, c, map, 512), -1);
    /* A good map is copied, and pad follows cfg->engram_pad_id through it. */
    c->engram_pad_id = 9;
    assert_int_equal(engram_set_token_map(&ec, c, map, 512), 0);
    assert_int_equal(ec.pad, 4);
    map[100] = 0;
    assert_int_equal(ec.token_map[100], 50);
    engram_consts_free(&ec);
    assert_null(ec.token_map);
    free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_real_primes_offsets),
        cmocka_unit_test(test_real_multipliers),
        cmocka_unit_test(test_numpy_rng_table),
        cmocka_unit_test(test_numpy_rng_rejection),
        cmocka_unit_test(test_next_prime),
        cmocka_unit_test(test_small6_consts),
        cmocka_unit_test(test_tp8pp2_consts),
        cmocka_unit_test(test_small6_prompt0_ids),
        cmocka_unit_test(test_tp8pp2_prompt0_ids),
        cmocka_unit_test(test_dead_blocks_cumulatively),
        cmocka_unit_test(test_sum_mismatch),
        cmocka_unit_test(test_bad_shapes),
        cmocka_unit_test(test_token_map_checks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
